"""A process killed with SIGKILL while saving checkpoints (synchronously or with
``async_save``): ``last_checkpoint`` always names a file that loads, and holds the state
that was saved under that name; and killed while it overwrites a name it saved before
(``model_final.pth`` saved again, ``model_best.pth`` improved), the file of that name still
loads with its old content.

One helper process imports torch once and forks a saver for each kill, so ten kills cost
well under the time of ten interpreter starts.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import hookloop
import pytest
import torch
from hookloop.checkpoint import Checkpointer
from torch import nn

TIMEOUT = 60
KILLS = 10

ZYGOTE = """
    import os, signal, sys, time
    import torch
    from torch import nn
    from hookloop.checkpoint import Checkpointer, PeriodicCheckpointer

    torch.set_num_threads(1)
    save_dir = sys.argv[1]
    model = nn.Linear(512, 512)  # 1 MB of weights: a save takes a few milliseconds
    print("ready", flush=True)
    for line in sys.stdin:
        delay, start, use_async = line.split()
        delay, start, use_async = float(delay), int(start), use_async == "1"
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the saver: saves forever, a new iteration each time
            os.close(r)
            try:
                ckpt = Checkpointer(model, save_dir, async_save=use_async)
                periodic = PeriodicCheckpointer(ckpt, 1, max_to_keep=2)
                it = start
                while True:
                    with torch.no_grad():
                        model.weight.fill_(float(it))
                        model.bias.fill_(float(it))
                    periodic.step(it)
                    if it == start:
                        ckpt.wait()
                        os.write(w, b"x")  # one save is complete
                    it += 1
            finally:
                os._exit(1)
        os.close(w)
        started = os.read(r, 1)
        os.close(r)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        print("killed" if started and killed else "failed", flush=True)
"""


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        pytest.fail(f"the helper process did not answer within {timeout} s")
    return proc.stdout.readline().strip()


def _check_last_checkpoint(save_dir: Path) -> int:
    """Loads what last_checkpoint names; returns its iteration."""
    ckpt = Checkpointer(nn.Linear(512, 512), str(save_dir))
    assert ckpt.has_checkpoint()
    path = ckpt.get_checkpoint_file()
    name = os.path.basename(path)
    assert name.startswith("model_") and name.endswith(".pth"), name
    extra = ckpt.load(path)
    it = extra["iteration"]
    assert name == f"model_{it:07d}.pth"
    assert torch.equal(ckpt.model.weight, torch.full((512, 512), float(it)))
    assert torch.equal(ckpt.model.bias, torch.full((512,), float(it)))
    return it


def _env() -> dict:
    """The environment of a child: it imports this hookloop."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(hookloop.__file__)), env.get("PYTHONPATH", "")]
    )
    return env


@pytest.mark.slow
def test_sigkill_during_saves_leaves_a_loadable_last_checkpoint(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(ZYGOTE), str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    rng = random.Random(0)
    seen = []
    try:
        assert _readline(proc, TIMEOUT) == "ready"
        for k in range(KILLS):
            # Kill points spread over a few saves (each takes milliseconds).
            delay = rng.uniform(0, 0.05)
            use_async = k % 2  # every other run saves on a background thread
            proc.stdin.write(f"{delay} {k * 1000} {use_async}\n")
            proc.stdin.flush()
            assert _readline(proc, TIMEOUT) == "killed"
            it = _check_last_checkpoint(tmp_path)
            assert it >= k * 1000  # this run's save, not an older one
            seen.append(it)
            # max_to_keep=2 holds across restarts: at most one extra file, from a kill
            # between a save and the deletion that follows it.
            periodic = [n for n in os.listdir(tmp_path) if n.endswith(".pth")]
            assert len(periodic) <= 3, periodic
            # A kill mid-write leaves at most one temporary file: the next run's first save
            # removes those of dead processes.
            tmp_files = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
            assert len(tmp_files) <= 1, tmp_files
    finally:
        proc.stdin.close()
        try:
            proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait(TIMEOUT)
        proc.stdout.close()
    assert proc.returncode == 0
    assert len(seen) == KILLS


OVERWRITE = """
    import io, sys, threading
    import torch
    from torch import nn
    from hookloop.checkpoint import Checkpointer
    from hookloop.engine import BestCheckpointer, EvalHook, TrainerBase

    torch.set_num_threads(1)
    save_dir, case, use_async = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    model = nn.Linear(512, 512)
    ckpt = Checkpointer(model, save_dir, async_save=use_async)
    real_save, saves = torch.save, []

    def save_half_then_wait(obj, f, *args, **kwargs):
        # The first save is whole; the second puts the first half of its bytes where the
        # checkpointer writes, says so, and waits to be killed.
        saves.append(1)
        if len(saves) == 1:
            return real_save(obj, f, *args, **kwargs)
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        print("half", flush=True)
        threading.Event().wait()

    torch.save = save_half_then_wait

    def fill(value):
        with torch.no_grad():
            model.weight.fill_(value)
            model.bias.fill_(value)

    if case == "final":  # model_final.pth saved at iteration 1, then again at 2
        for it in (1, 2):
            fill(float(it))
            ckpt.save("model_final", iteration=it)
            ckpt.wait()
    else:  # model_best.pth saved at iteration 0 (weights 1), improved at 1 (weights 2)

        class Trainer(TrainerBase):
            def run_step(self):
                fill(float(self.iter + 1))

        accuracies = iter([0.5, 0.7])
        trainer = Trainer()
        trainer.register_hooks(
            [EvalHook(1, lambda: {"acc": next(accuracies)}), BestCheckpointer(1, ckpt, "acc")]
        )
        trainer.train(0, 3)
    print("not killed", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "case, name, old_iteration, old_value",
    [("final", "model_final.pth", 1, 1.0), ("best", "model_best.pth", 0, 1.0)],
    ids=["final", "best"],
)
def test_sigkill_while_overwriting_a_name_keeps_its_old_file(
    tmp_path, case, name, old_iteration, old_value, use_async
):
    """The kill lands while the new file of a name is half written (the child's torch.save
    writes half, says so on stdout and blocks): the name still holds the whole old file.
    A save that wrote in place would leave half a file under the name, which fails to load."""
    save_dir = tmp_path / "out"
    save_dir.mkdir()
    with open(tmp_path / "stderr", "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(OVERWRITE), str(save_dir), case]
            + [str(int(use_async))],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=_env(),
        )
        try:
            said = _readline(proc, TIMEOUT)
        finally:
            proc.kill()
            proc.wait(TIMEOUT)
            proc.stdout.close()
    assert said == "half", (tmp_path / "stderr").read_text()
    assert proc.returncode == -signal.SIGKILL

    ckpt = Checkpointer(nn.Linear(512, 512), str(save_dir))
    extra = ckpt.load(str(save_dir / name))
    assert extra["iteration"] == old_iteration
    assert torch.equal(ckpt.model.weight, torch.full((512, 512), old_value))
    assert torch.equal(ckpt.model.bias, torch.full((512,), old_value))
    # The half-written bytes are in a temporary file (which the next save removes); the best
    # model never moves last_checkpoint.
    files = sorted(os.listdir(save_dir))
    tmp = [n for n in files if n.endswith(".tmp")]
    assert len(tmp) == 1 and tmp[0].startswith(f".{name}."), files
    others = [n for n in files if n not in tmp]
    assert others == (["last_checkpoint", name] if case == "final" else [name])
    if case == "final":
        assert ckpt.get_checkpoint_file() == str(save_dir / name)
