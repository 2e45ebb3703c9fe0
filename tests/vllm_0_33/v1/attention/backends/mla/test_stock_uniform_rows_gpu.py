"""Stock 0.33.0's uniform flattening kernel lays out varlen rows (GPU only).

On a uniform step without graph padding the plugin's 0.33 builder lets
stock's flatten branch write the rows (its Triton
``_PREPARE_UNIFORM_DECODE_KERNEL``: context lengths, block-table rows,
decode lengths of 1) and adds only the run ids.  Here the real kernel, on
the GPU, against :func:`vllm_dsa_varlen.plan.plan_decode_rows` (the
project's single source of the layout) on fresh random steps.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

import vllm.v1.attention.backends.mla.indexer as ix  # noqa: E402

from vllm_dsa_varlen.plan import plan_decode_rows  # noqa: E402


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("reqs", [1, 7, 64, 200])
def test_stock_uniform_kernel_writes_plan_decode_rows(n, reqs):
    gen = torch.Generator().manual_seed(1000 * n + reqs)
    width, max_rows = 37, 2048
    dev = torch.device("cuda")
    seq = (n + torch.randint(0, 40000, (reqs,), generator=gen)).to(torch.int32).to(dev)
    bt = torch.randint(0, 1 << 20, (reqs, width), generator=gen, dtype=torch.int32).to(dev)
    rows = reqs * n
    ctx = torch.full((max_rows,), -7, dtype=torch.int32, device=dev)  # poisoned
    bt_out = torch.full((max_rows, width), -7, dtype=torch.int32, device=dev)
    lens = torch.full((max_rows,), -7, dtype=torch.int32, device=dev)
    ix._PREPARE_UNIFORM_DECODE_KERNEL(seq, ctx, bt, bt_out, lens, rows, n)
    qsl = torch.arange(0, rows + 1, n, dtype=torch.int32, device=dev)
    want = plan_decode_rows(seq, qsl, bt, num_rows=rows, uniform_len=n)
    torch.cuda.synchronize()
    assert torch.equal(ctx[:rows], want.context_lens)
    assert torch.equal(bt_out[:rows], want.block_table)
    assert torch.equal(lens[:rows], torch.ones(rows, dtype=torch.int32, device=dev))
