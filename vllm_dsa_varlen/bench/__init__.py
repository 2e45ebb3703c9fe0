"""The benchmark (``vllm-dsa-varlen-bench``, ``python -m vllm_dsa_varlen.bench``).

Nothing the plugin runs while serving imports this package
(``tests/test_import_graph.py``).  Its modules:

* :mod:`.logits` — the command: every paged-MQA-logits path this machine has
  on the same decode steps (the default mode), and the dispatch to the others;
* :mod:`.schedule` — ``--plan-timing``: the sm_90 kernel's per-step schedule
  beside ``plan_torch`` and DeepGEMM's metadata;
* :mod:`.launch` — ``--launch-host``: the host time of eager calls (``--fake``
  with the driver stubbed, on the CPU);
* :mod:`.builds` — ``--builds``: the CUDA kernel's builds in one process,
  beside DeepGEMM and vLLM's top-k, per call and per decode step;
* :mod:`.deepgemm` — the DeepGEMM paths (2.8.2, vLLM 0.33's 2.8.1);
* :mod:`.graph` — timing helpers the modes share (graph replay, L2 flushes,
  the rounds' order);
* :mod:`.workloads` — decode steps as serving makes them (also the tests'
  inputs).
"""
