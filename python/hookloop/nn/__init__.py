"""Neural-network helpers, mirroring ``fvcore.nn``: precise BatchNorm statistics."""

from hookloop.nn.precise_bn import BN_MODULE_TYPES, get_bn_modules, update_bn_stats

__all__ = ["BN_MODULE_TYPES", "get_bn_modules", "update_bn_stats"]
