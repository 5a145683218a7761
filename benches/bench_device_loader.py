"""The tiny MLP with the default stack, fed by ``DeviceResidentLoader`` against the same fed by
``DataLoader(TensorDataset, shuffle=True)``: the data time per step (``next()`` on the
loader's iterator, timed alone) and the steps per second of the whole run.

The dataset is 50,000 samples of 32 features (the tiny MLP's input) in batches of 16, as in
issue 44's figures. The two loaders are measured in alternating rounds (drift affects both)
and the medians and their ratio are printed. On a machine with CUDA, ``--device cuda`` keeps
the data on the GPU (the DataLoader then uses ``pin_memory=True`` and copies each batch).

```
python benches/bench_device_loader.py            # ~1 min on a CPU
python benches/bench_device_loader.py --quick    # ~15 s
```
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import torch
from hookloop.bench import TinyMLP
from hookloop.data import DeviceResidentLoader
from hookloop.engine import SimpleTrainer, hooks
from hookloop.utils.events import CommonMetricPrinter, JSONWriter, TensorboardXWriter

SIZE, FEATURES, BATCH = 50_000, 32, 16


def _data(device: str) -> Any:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SIZE, FEATURES, generator=g)
    y = x @ torch.randn(FEATURES, 1, generator=g)
    return x, y


def _loaders(device: str) -> Dict[str, Callable[[], Any]]:
    x, y = _data(device)
    dataset = torch.utils.data.TensorDataset(x, y)
    cuda = device.startswith("cuda")

    def dataloader() -> Any:
        return torch.utils.data.DataLoader(dataset, BATCH, shuffle=True, pin_memory=cuda)

    def resident() -> Any:
        return DeviceResidentLoader((x, y), BATCH, seed=0, device=device)

    return {"DataLoader(shuffle=True)": dataloader, "DeviceResidentLoader": resident}


def _to(batch: Any, device: str) -> Any:
    return [t.to(device, non_blocking=True) for t in batch]


def data_time(make: Callable[[], Any], device: str, n: int) -> float:
    """µs per ``next()`` (and, for a host loader, the copy to the device)."""
    it = iter(make())
    move = device != "cpu"
    start = time.perf_counter()
    for _ in range(n):
        batch = next(it)
        if move:
            batch = _to(batch, device)
    if move:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def steps_per_s(make: Callable[[], Any], device: str, n: int) -> float:
    torch.manual_seed(0)
    model = TinyMLP().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [10**9])
    loader = make()

    class Moved:
        """A host loader's batches copied to the device (what the hand loop does)."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __len__(self) -> int:
            return len(self.inner)

        def __iter__(self) -> Any:
            return (_to(b, device) for b in self.inner)

    if device != "cpu" and not isinstance(loader, DeviceResidentLoader):
        loader = Moved(loader)
    trainer = SimpleTrainer(model, loader, opt)
    with tempfile.TemporaryDirectory() as d:
        trainer.register_hooks(
            [
                hooks.IterationTimer(),
                hooks.LRScheduler(opt, sched),
                hooks.PeriodicWriter(
                    [CommonMetricPrinter(n), JSONWriter(os.path.join(d, "m.json")),
                     TensorboardXWriter(d)],
                    20,
                ),
            ]
        )  # fmt: skip
        start = time.perf_counter()
        trainer.train(0, n)
        if device != "cpu":
            torch.cuda.synchronize()
        return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import logging

    logging.disable(logging.INFO)  # the printer's lines
    n, rounds = (1000, 3) if args.quick else (3000, 5)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {platform.machine()}, "
          f"device {args.device}")  # fmt: skip
    options = (" --quick" if args.quick else "") + (
        "" if args.device == "cpu" else f" --device {args.device}"
    )
    print(f"command: python benches/bench_device_loader.py{options}\n")
    loaders = _loaders(args.device)
    res: Dict[str, Dict[str, List[float]]] = {k: {"data": [], "steps": []} for k in loaders}
    for _ in range(rounds):
        for name, make in loaders.items():
            res[name]["data"].append(data_time(make, args.device, n))
            res[name]["steps"].append(steps_per_s(make, args.device, n))
    print(f"{SIZE:,} x {FEATURES} samples, batch {BATCH}; {n:,} steps x {rounds} rounds, medians")
    print("| loader | data µs/step | steps/s, tiny MLP + default stack |\n|---|---|---|")
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in res.items()}
    for name, m in med.items():
        print(f"| {name} | {m['data']:.1f} | {m['steps']:,.0f} |")
    host, dev = med["DataLoader(shuffle=True)"], med["DeviceResidentLoader"]
    print(
        f"\nDeviceResidentLoader: data time {dev['data'] / host['data']:.3f}x the DataLoader's, "
        f"steps/s {dev['steps'] / host['steps']:.2f}x"
    )


if __name__ == "__main__":
    main()
