from setuptools import find_packages, setup

RAY = ["ray[default,train]>=2.60,<3", "datasets>=3"]
FP8 = ["torchao>=0.14"]
# lm-evaluation-harness: 0.4.10 is the first whose HFLM encodes as the tokenizer is configured (a
# Llama BOS kept, as preprocessing keeps it), which the adapter matches, and the first without
# torch, transformers, accelerate and peft in its own requirements (tested: 0.4.10 and 0.4.13).
EVAL = ["lm_eval>=0.4.10"]

setup(
    name="megatron_lite",
    version="0.1.0",
    description="Config-driven, Megatron-style LLM pretraining on DeepSpeed (CUDA, HPU, CPU)",
    packages=find_packages(include=["megatron_lite", "megatron_lite.*"]),
    python_requires=">=3.10",
    # torch is not pinned: GPU/HPU systems bring their own build (the Makefile pins the CPU one).
    install_requires=[
        "torch>=2.6",
        # From the lowest release the DeepSpeed-facing tests pass on (docs/hardware.md), the base
        # of Habana's fork (0.16.1+hpu), which this range keeps installed, to below the next minor
        # release after the newest one the whole suite passes on (0.19.8): engine/internals.py
        # relies on names a new release may rename, so a release is admitted once it is tested.
        "deepspeed>=0.16.1,<0.20",
        "packaging>=23",
        "omegaconf>=2.3",
        # Qwen3's classes (import and export) arrived in 4.51.
        "transformers>=4.51",
        "sentencepiece>=0.2",
        "numpy>=1.24",
        "wandb>=0.17",
        "tensorboard>=2.15",
        # Imported by our code directly (the run clock, checkpoint conversion, the preprocessing
        # progress bar), not only through DeepSpeed and transformers.
        "psutil>=5.9.5",
        "pyyaml>=6.0",
        "tqdm>=4.64",
    ],
    # pyarrow: parquet input to tools/preprocess_data.py; matplotlib: tools/spike_report.py --plot and
    # tools/plot_run.py, plotext its --terminal plots (5.x: 6 changed the whole API)
    # (optional for users, tested here); mpich: an mpiexec (MPICH's Hydra) for running
    # launch/polaris.sh on a workstation and in the tests. ray: launch/ray_train.py (Ray Train 2;
    # "default" brings the dashboard, whose state API Ray Train's controller queries) and
    # Hugging Face datasets as preprocessing input.
    # fp8: model.fp8 (torchao's float8 training; pick the torchao release built for your torch).
    # eval: tools/evaluate.py and megatron_lite.evaluation (downstream tasks); the tests compare it
    # with lm_eval's own HFLM, which needs accelerate.
    extras_require={"report": ["matplotlib>=3.7", "plotext>=5.2,<6"],
                    "ray": RAY,
                    "fp8": FP8,
                    "eval": EVAL,
                    "test": ["pytest>=8.2", "pytest-xdist>=3.6", "pytest-timeout>=2.3", "ruff>=0.6",
                             "pyarrow>=14", "matplotlib>=3.7", "plotext>=5.2,<6",
                             "mpich>=4; sys_platform == 'linux'", *RAY, *FP8, *EVAL,
                             "accelerate>=0.26"]},
)
