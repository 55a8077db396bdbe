"""megatron-lite's benchmarks, a package: run each from the repository root as a module,
e.g. `python -m benchmarks.compare_ddp --tiny --cpu` (see docs/performance.md).

Scripts share code through the helper modules here (launch, timing, counting, reporting, gpt_step,
prediction, mlp_memory, the *_report and *_systems modules) by absolute imports
(`from benchmarks.launch import launch`); none imports another script, and none changes sys.path.
"""
