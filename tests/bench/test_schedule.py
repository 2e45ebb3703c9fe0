"""vllm_dsa_varlen/bench/schedule.py (``vllm-dsa-varlen-bench --plan-timing``): its
arguments and its table on the CPU (the timing itself needs a GPU)."""

import pytest

from vllm_dsa_varlen.bench import logits as bench
from vllm_dsa_varlen.bench import schedule


@pytest.mark.parametrize("argv, message", [
    (["--plan-timing", "--cases", "64,4"], "--cases: expected requests,tokens,context"),
    (["--plan-timing", "--cases", "64,0,8192"], "--cases: expected requests >= 1, tokens != 0"),
    (["--plan-timing", "--rounds", "0"], "argument --rounds: expected an int >= 1"),
    (["--plan-timing", "--heads", "16"], "argument --heads: invalid choice: 16"),
])
def test_bad_plan_timing_arguments_are_refused(argv, message, capsys):
    """Refused before the run, by the flag's name (argparse's exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(ValueError, match="--heads: --plan-timing times the planner's builds"):
        schedule.head_counts(16)


def test_parse_case_reads_variable_steps():
    assert schedule.parse_case("64,-4,8192") == (64, -4, 8192)
    assert all(schedule.parse_case(c) for c in schedule.CASES)


def test_head_counts_default_to_both_builds():
    assert schedule.head_counts(None) == (64, 32)
    assert schedule.head_counts(32) == (32,) and schedule.head_counts(64) == (64,)
    from vllm_dsa_varlen.ops import cuda_plan

    assert sorted(schedule.HEADS) == sorted(cuda_plan.HEAD_COUNTS)


def test_plan_timing_needs_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--plan-timing: needs a CUDA GPU"):
        bench.main(["--plan-timing"])


def test_table_columns_medians_and_ranges():
    """The printed table: the columns of the paths timed anywhere, each cell the
    median [min-max] of the rounds, "-" where a case lacks the path, "NO"
    where the planner differed, each row's head count; the JSON rows carry
    every round."""
    floor = dict(case="floor (add_)", heads=0, rows=0, same=True,
                 times={"floor": ([4.0, 5.0, 4.5], [0.5, 0.7, 0.6])})
    one = dict(case="64,4,32768", heads=32, rows=263, same=True,
               times={"plan_torch": ([150.0, 140.0, 160.0], [130.0, 131.0, 129.0]),
                      "planner": ([9.0, 8.0, 10.0], [6.0, 5.5, 6.5])})
    two = dict(case="64,-4,8192", heads=64, rows=170, same=False,
               times={"plan_torch": ([120.0, 121.0, 119.0], [100.0, 100.0, 100.0]),
                      "planner": ([7.0, 7.0, 7.0], [5.0, 5.0, 5.0]),
                      "dg_meta_flat": ([12.0, 11.0, 13.0], [3.0, 3.0, 3.0])})
    lines, results = schedule.format_table([floor, one, two], 3)
    assert lines[0].startswith("\nµs, median over 3 rounds")
    assert lines[1] == "floor (one-element add_): replay 4.5 [4.0-5.0], /copy 0.60"
    head = lines[2].split()
    assert [w for w in head if w in schedule.NAMES] == ["plan_torch", "plan_torch", "planner",
                                                         "planner", "dg_meta_flat",
                                                         "dg_meta_flat"]
    assert head[:4] == ["case", "heads", "rows", "same"]
    assert lines[3].split()[:4] == ["64,4,32768", "32", "263", "yes"]
    assert "150.0 [140.0-160.0] 130.00 [129.0-131.0]" in lines[3]
    assert "9.0 [  8.0- 10.0]   6.00 [ 5.5- 6.5]" in lines[3]
    assert lines[3].rstrip().endswith("-")
    assert lines[4].split()[:4] == ["64,-4,8192", "64", "170", "NO"]
    assert "12.0 [ 11.0- 13.0]   3.00 [ 3.0- 3.0]" in lines[4]
    assert results[1]["bitwise_equal"] is False
    assert [r["heads"] for r in results] == [32, 64]
    assert results[0]["planner"] == dict(replay_us=[9.0, 8.0, 10.0], per_copy_us=[6.0, 5.5, 6.5])
    assert "dg_meta_flat" not in results[0]


@pytest.mark.parametrize("heeds_cut", [True, False])
@pytest.mark.parametrize("heads", [64, 32])
def test_prepare_case_checks_the_planner_with_and_without_the_cut(monkeypatch, heads,
                                                                 heeds_cut):
    """On the CPU, with a stand-in planner (plan_torch written into the
    poisoned buffers): each planner path is checked against plan_torch with
    its own cut_items first (a planner that ignores the cut is reported as a
    mismatch on a step that is cut) and timed with that cut_items."""
    import torch

    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
    from vllm_dsa_varlen.ops import cuda_plan as cp
    from vllm_dsa_varlen.bench.workloads import random_decode_step

    calls = []

    def planner(ids, ctx, max_len, width, *, heads, out, cut_items=0):
        calls.append(cut_items)
        got = ck.plan_torch(ids, ctx.view(-1, 1), max_len, width, heads,
                            cut_items=cut_items if heeds_cut else 0)
        for o, g in zip(out, got):
            o.copy_(g)
        return out

    sms = 132
    monkeypatch.setattr(cp, "allocate", lambda rows, programs, device: (
        torch.empty((rows, cp.TABLE_WORDS), dtype=torch.int32),
        torch.empty((programs, cp.CTA_WORDS), dtype=torch.int32)))
    monkeypatch.setattr(cp, "plan_device", planner)
    monkeypatch.setattr(ck, "num_sms", lambda device: sms)  # as on the GPU: the grid's CTAs
    monkeypatch.setattr(schedule, "graph_of", lambda torch, fn, copies: fn)
    tokens = ck.rows_max_for(heads, 0)  # a chunk's rows: the runs the cut takes
    step = random_decode_step(2, tokens, 2048, seed=heads, heads=heads)
    got = schedule.prepare_case(torch, "2,x,2048", heads, step.rows, step.max_context_len,
                                  step.rows.block_table.shape[1], None, sms, None)
    cut = ck.cut_items_for(heads, sms)
    assert set(got["graphs"]) == {"plan_torch", "planner", "planner_cut"}
    assert calls == [0, cut] and got["same"] is heeds_cut
    for name, want in (("planner", 0), ("planner_cut", cut)):
        got["graphs"][name][0]()
        assert calls[-1] == want
