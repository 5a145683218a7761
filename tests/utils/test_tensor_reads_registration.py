"""The storage's pending queue reads device tensors through functions that
``hookloop.utils._tensors`` hands to the extension at its import (the extension imports nothing
of the package). A storage entered once torch is imported imports it (a storage used on its
own, without hookloop.engine); before that import, a read that needs them is a clear
``RuntimeError`` naming the module, never a panic; after it, the same read works.

Run in fresh interpreters: the registration is for the life of the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from hookloop.utils.events import EventStorage

    assert "hookloop.utils._tensors" not in sys.modules

    class OnDevice(torch.Tensor):
        @property
        def is_cpu(self):
            return False

    s = EventStorage()  # not entered
    s.put_scalar("acc", torch.tensor(0.5).as_subclass(OnDevice))
    try:
        s.latest()
    except RuntimeError as e:
        print("before:", e)
    import hookloop.utils._tensors  # registers the reads
    s.put_scalar("acc", torch.tensor(0.25).as_subclass(OnDevice))
    print("after:", s.history("acc").values())
    """
)


def test_a_read_before_the_registration_names_the_module_and_works_after():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("before: ") and "import hookloop.utils._tensors" in lines[0]
    assert "PanicException" not in out.stderr
    # The value that failed to read was dropped with its batch; the next one reads.
    assert lines[1] == "after: [(0.25, 0)]"


ENTERED = textwrap.dedent(
    """
    import sys
    import torch
    from hookloop.utils.events import EventStorage

    assert "hookloop.utils._tensors" not in sys.modules
    on_device = type("OnDevice", (torch.Tensor,), {"is_cpu": property(lambda self: False)})
    with EventStorage() as s:
        s.put_scalar("acc", torch.tensor(0.5).as_subclass(on_device))
        print(s.history("acc").values())
    """
)


def test_a_storage_entered_with_torch_imported_reads_tensors_on_its_own():
    out = subprocess.run(
        [sys.executable, "-c", ENTERED], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[(0.5, 0)]"
