"""torch CPU tensors, directly (DLPack) and through `tensor.numpy()` (the buffer protocol).
Skipped when torch is not installed (CI does not install it)."""

import pytest

try:
    import torch
except ImportError:
    pytest.skip("skipped: torch not installed", allow_module_level=True)

import lockstep


def test_torch_cpu_tensor_in_place_through_numpy():
    def body():
        c = lockstep.comm()
        t = torch.full((4, 3), float(c.rank + 1))
        c.all_reduce(t.numpy())  # in place: the tensor itself holds the sum
        g = torch.zeros(c.world_size * 2, dtype=torch.int64)
        c.all_gather(torch.full((2,), c.rank, dtype=torch.int64).numpy(), g.numpy())
        return t, g

    for t, g in lockstep.notebook_launcher(body, num_processes=2):
        assert torch.equal(t, torch.full((4, 3), 3.0))
        assert g.tolist() == [0, 0, 1, 1]


def test_torch_import_in_the_caller_does_not_block_forking():
    assert not torch.cuda.is_initialized()
    lockstep.check_fork_safe()
    assert lockstep.notebook_launcher(lambda: torch.ones(2).sum().item(), num_processes=2) == [2.0, 2.0]


def test_torch_tensors_directly_through_dlpack_including_bfloat16():
    def body():
        c = lockstep.comm()
        t = torch.full((5,), float(c.rank + 1), dtype=torch.bfloat16)
        c.all_reduce(t)  # no buffer protocol on tensors: DLPack
        out = torch.zeros(4, dtype=torch.float32)
        c.all_gather(torch.full((2,), float(c.rank)), out)
        with pytest.raises(ValueError, match="not C-contiguous"):
            c.all_reduce(torch.ones(4, 4).t())
        return t, out

    for t, out in lockstep.notebook_launcher(body, num_processes=2):
        assert t.dtype == torch.bfloat16 and torch.equal(t, torch.full((5,), 3.0, dtype=torch.bfloat16))
        assert out.tolist() == [0.0, 0.0, 1.0, 1.0]
