from setuptools import find_packages, setup

setup(
    name="megatron-lite",
    version="0.1.0",
    description="A lean re-implementation of Megatron-LM's data-parallel training stack (CPU/gloo and CUDA/NCCL)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_lite", "megatron_lite.*"]),
    python_requires=">=3.9",
    # Core: torch and numpy only. Pin torch yourself where an unpinned install would pull a CUDA build.
    install_requires=["torch>=2.1", "numpy"],
    extras_require={
        "progress": ["tqdm"],  # preprocessing progress bar (a plain line is printed without it)
        "bench": ["matplotlib"],  # plots: the benchmarks', tools/plot_metrics.py's loss curves
        "tensorboard": ["tensorboard"],
        # Everything the Hugging Face paths need, one extra: --tokenizer-type HuggingFaceTokenizer (tokenizers),
        # tools/checkpoint_convert.py --to hf / --from hf (safetensors, tokenizers), loading the export
        # (transformers), and the Hugging Face versions of the third-party-model tests (transformers, peft,
        # accelerate). Pinned: newer releases may ask for a newer torch, which pip would fetch as a multi-GB CUDA
        # build. tests/checkpointing/test_hf_extra.py keeps every mention of it in the repository agreeing.
        "hf": ["transformers==5.24.0", "peft==0.21.2", "accelerate==1.15.0", "safetensors==0.8.0",
               "tokenizers==0.23.3"],
        # megatron-core as the reference of the Megatron-LM checkpoint and tokenizer tests (its GPTModel,
        # optimizer and dist_checkpointing on the CPU: tests/support/mcore_reference.py), and SentencePiece for
        # --tokenizer-type SentencePieceTokenizer / GPTSentencePieceTokenizer / Llama2Tokenizer. Pinned like hf.
        "megatron": ["megatron-core==0.16.1", "sentencepiece==0.2.3", "psutil"],
        "dev": ["pytest>=7", "pytest-timeout", "matplotlib", "tqdm", "ruff==0.17.6"],
    },
)
