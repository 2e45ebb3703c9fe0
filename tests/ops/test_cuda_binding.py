"""vllm_dsa_varlen/ops/cuda_binding.py: what runs without a GPU."""

import threading

import torch

from vllm_dsa_varlen.ops import cuda_binding as cb


def test_load_once_makes_each_device_and_build_once_across_threads():
    """Every thread asking for one (device, build) gets the one object made
    for it; another device or build gets its own; the maker is handed the
    device with its index and the build."""
    made = []
    start = threading.Barrier(8)

    def make(device, build):
        made.append((device, build))
        return object()

    cache, lock, got = {}, threading.Lock(), [None] * 8

    def ask(i):
        start.wait()
        got[i] = cb.load_once(cache, lock, torch.device("cuda", 1), ("SPLIT=2",), make)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [(torch.device("cuda", 1), ("SPLIT=2",))]
    assert all(g is got[0] for g in got)
    other = cb.load_once(cache, lock, "cuda:2", ("SPLIT=2",), make)
    again = cb.load_once(cache, lock, "cuda:1", ("SPLIT=4",), make)
    assert other is not got[0] and again is not got[0] and other is not again
    assert set(cache) == {(1, ("SPLIT=2",)), (2, ("SPLIT=2",)), (1, ("SPLIT=4",))}
    assert cb.load_once(cache, lock, torch.device("cuda", 2), ("SPLIT=2",), make) is other
    assert len(made) == 3
