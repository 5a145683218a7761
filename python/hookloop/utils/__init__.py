"""Utilities mirroring ``detectron2.utils``: ``events`` (metric storage and writers), ``comm``."""
