"""The one typed schema of a recipe.

Every key a recipe may set is a field below, with its default and a docstring under it. Fields
with a fixed set of values declare them with ``choice(...)``; the loader checks them and names
the allowed values. Defaults live here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional


def choice(default: Any, *allowed: Any) -> Any:
    """A field whose value must be one of ``allowed`` (the default is always allowed)."""
    return field(default=default, metadata={"choices": (default, *allowed)})


@dataclass(frozen=True)
class TokenizerConfig:
    type: str = choice("sentencepiece", "huggingface", "char", "megatron-sentencepiece")
    """Tokenizer family: a sentencepiece ``.model`` file, a Hugging Face tokenizer directory, a
    character-level vocabulary (JSON list of characters), or ``megatron-sentencepiece``:
    Megatron-LM's ``SentencePieceTokenizer`` over a ``.model`` file (its extra special tokens
    and ``<EOD>``), for data made by Megatron-LM with that tokenizer."""
    model: Optional[str] = None
    """Path of the tokenizer: the ``.model`` file, the Hugging Face directory, or the char JSON."""
    vocab_size: Optional[int] = None
    """The vocabulary the recipe expects of this tokenizer: ``--dry-run`` and ``--plan`` use it
    while the tokenizer is not on disk (they never download one from the Hugging Face Hub); a
    run uses the tokenizer's own (and warns when they differ). Null: only the tokenizer says (on
    disk, or for a Hub name in the local Hugging Face cache)."""


@dataclass(frozen=True)
class BlendEntry:
    prefix: str = ""
    """Prefix of one indexed dataset (``PREFIX.bin``/``PREFIX.idx``)."""
    weight: float = 1.0
    """Its share of the samples (weights are normalised over the blend)."""
    name: Optional[str] = None
    """The name its own validation loss is reported under (``val_loss/NAME``); null: the
    prefix's file name."""


@dataclass(frozen=True)
class DataConfig:
    prefix: Optional[str] = None
    """Prefix of the indexed dataset (``PREFIX.bin``/``PREFIX.idx``), e.g.
    ``data/shakespeare/works_text_document``; give this or ``blend``."""
    blend: list[BlendEntry] = field(default_factory=list)
    """Several datasets mixed by weight, e.g. ``[{prefix: a_text_document, weight: 0.7}, ...]``;
    every prefix of the sample stream matches the weights to within one sample."""
    split: str = "98,2,0"
    """Train, validation and test shares of each dataset (Megatron's ``"969,30,1"`` style)."""
    split_by: str = choice("documents", "tokens")
    """``documents``: contiguous document ranges, samples through Megatron's document/sample/
    shuffle indices (documents reshuffled each epoch). ``tokens``: contiguous token ranges of the
    stream cut into windows (for corpora of one or few documents, like tinyshakespeare)."""
    cache_dir: Optional[str] = None
    """Where the sample indices are cached; null means ``index-cache`` beside the data."""
    cache_shared: bool = True
    """True: ``cache_dir`` is on a filesystem all nodes share, rank 0 builds the indices. False:
    it is node-local, local rank 0 of every node builds them."""
    build_from: Optional[str] = None
    """Raw text (a ``.txt`` file: one document; or ``.jsonl`` with a ``text`` key) to build the
    dataset (and, for ``char``, the vocabulary) from when ``prefix`` does not exist yet. An
    ``http(s)://`` URL is downloaded once, into the folder of ``prefix`` under the URL's file
    name, and built from there."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """How text becomes tokens."""
    seq_length: int = 1024
    """Tokens per training sample (each sample reads ``seq_length + 1`` tokens)."""
    eod_mask_loss: bool = False
    """Leave the prediction made at each end-of-document token (of the next document's first
    token, which nothing before it can tell) out of the loss and its mean: Megatron's
    ``--eod-mask-loss``. Pairs with ``model.attention_mask: document``; needs the
    end-of-document id (``model.eod_id`` or the tokenizer's). The loss is each micro-batch's
    mean over the predictions it counts (whatever the sequence split), averaged over
    micro-batches and data ranks as Megatron-DeepSpeed does: it moves a little with how the
    global batch is cut into micro-batches (a micro-batch with nothing counted adds 0)."""
    num_workers: int = 1
    """Data-loader worker processes per rank (0 reads in the training process)."""
    seed: int = 1234
    """Seed of the sample shuffle (independent of ``training.seed``)."""
    on_resume: str = choice("check", "new_phase")
    """When a resumed checkpoint was trained on other data (another ``prefix`` or ``blend``,
    other weights, ``split`` or ``seed``; a dataset is known by its file name and size):
    ``check`` refuses the resume, naming each difference; ``new_phase`` starts a data phase at
    the samples already consumed, reading the new data from its first sample (Megatron's phase
    transitions). Phases are recorded in every checkpoint; spike records name the phase."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: Optional[int] = None
    """Vocabulary size; null takes the tokenizer's, then pads it to ``vocab_multiple``."""
    vocab_multiple: int = 128
    """Pad the vocabulary to a multiple of this (1 keeps it as is)."""
    tokenizer_vocab_size: Optional[int] = None
    """Ids the tokenizer can produce. Rows of the embedding and output layer past it (the
    padding up to ``vocab_size``) start at zero and are masked out of the loss, evaluation and
    sampling, so every tensor-parallel size (each pads differently) computes the same function.
    Null: the tokenizer's (all of ``vocab_size`` without a tokenizer)."""
    n_layers: int = 12
    """Transformer blocks."""
    n_heads: int = 12
    """Attention (query) heads."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention; null means ``n_heads`` (multi-head)."""
    d_model: int = 768
    """Hidden size."""
    ffn_hidden: Optional[int] = None
    """MLP inner size; null means 4·d_model for GELU and Llama's rounded 8/3·d_model for SwiGLU."""
    ffn_multiple: int = 256
    """SwiGLU's derived ``ffn_hidden`` is rounded up to a multiple of this."""
    max_seq_len: Optional[int] = None
    """Longest sequence (size of learned positions / RoPE table); null means ``data.seq_length``."""
    position: str = choice("rope", "learned")
    """Position encoding: rotary (Llama) or learned absolute embeddings (GPT-2)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: str = choice("none", "llama3")
    """RoPE frequency scaling for contexts beyond the one trained first: ``llama3`` (Llama 3.1
    and later) divides the low frequencies (wavelengths over ``rope_original_max_len /
    rope_low_freq_factor``) by ``rope_scaling_factor``, keeps the high ones (wavelengths under
    ``rope_original_max_len / rope_high_freq_factor``) and blends those between; transformers'
    ``rope_type: llama3``."""
    rope_scaling_factor: float = 8.0
    """``rope_scaling: llama3``: how much longer the new context is (transformers' ``factor``)."""
    rope_low_freq_factor: float = 1.0
    """``rope_scaling: llama3``: transformers' ``low_freq_factor``."""
    rope_high_freq_factor: float = 4.0
    """``rope_scaling: llama3``: transformers' ``high_freq_factor``."""
    rope_original_max_len: int = 8192
    """``rope_scaling: llama3``: the context the model was first trained with (transformers'
    ``original_max_position_embeddings``)."""
    norm: str = choice("rmsnorm", "layernorm")
    """Normalisation layer."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""
    activation: str = choice("swiglu", "gelu", "gelu_exact")
    """MLP activation: SwiGLU (gated, Llama); GELU in GPT-2's tanh approximation (transformers'
    ``gelu_new``); or exact GELU with erf (nanoGPT, BERT and Megatron-LM's default; transformers'
    ``gelu``), which is also faster than the tanh form on CPUs."""
    bias: bool = False
    """Biases in linear layers and LayerNorm."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections only (Qwen2; ``bias`` puts them in every
    linear layer). Exported to transformers as ``Qwen2ForCausalLM``."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer."""
    qk_norm: bool = False
    """RMSNorm of every query and key head (one weight of ``head_dim`` each for queries and
    keys) before RoPE, as Qwen3: keeps attention logits from growing, a known cause of loss
    spikes. Exported to transformers as ``Qwen3ForCausalLM``."""
    attention_mask: str = choice("causal", "document")
    """``causal``: each token attends to every token before it in its sample. ``document``:
    only to those of its own document (a document ends at its ``eod_id`` token, which belongs to
    it), and positions (RoPE or learned) restart at each document's first token: Megatron's
    ``--reset-attention-mask --reset-position-ids``, torchtitan's block-causal mask. A sample
    that packs several documents then trains each as if it were alone."""
    eod_id: Optional[int] = None
    """The token id that ends each document in the data (for ``attention_mask: document``);
    null: the tokenizer's end-of-document id."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation; output projections are scaled down by
    sqrt(2·n_layers) (GPT-2/Megatron scaled init)."""
    activation_checkpointing: str = choice("none", "full", "selective")
    """Recompute activations in backward instead of storing them: ``full``, each block's from
    its input (``true`` means this); ``selective``, each block's cheap ops (norms, RoPE, the
    MLP's activation and products, residual adds) while the matrix products' and attention's
    outputs are kept (torchtitan's op-level selective checkpointing)."""
    fp8: bool = False
    """Float8 matrix products in the transformer blocks' linear layers (torchao's float8
    training, as torchtitan's ``float8`` converter: inputs and weights in e4m3, gradients in
    e5m2, one dynamic scale per tensor). Weights, gradients, optimizer state and checkpoints stay
    in the training precision; embeddings, norms, attention and the output layer are untouched.
    Fast on GPUs with float8 units (H100/H200, sm_89+; pair with ``training.precision: bf16``);
    elsewhere, the CPU included, the products are emulated: same numerics, slower. Needs
    ``pip install torchao``, ``parallel.tensor: 1``, ``parallel.tile_factor: 1``, and every block
    linear's sizes and micro_batch_size × seq_length multiples of 16."""

    ARCHITECTURE: ClassVar[tuple[str, ...]] = (
        "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "activation", "norm",
        "position", "bias", "qkv_bias", "tie_embeddings", "rope_theta", "qk_norm", "rope_scaling",
        "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len")
    """The fields that change what the weights compute: checkpoints record them, and a recipe
    that differs is refused at a resume (``checkpoint.strict_model``)."""

    # Sizes derived from the fields above, computed here once for every module that needs them.
    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (``n_kv_heads``, or ``n_heads`` without grouped-query attention)."""
        return self.n_kv_heads or self.n_heads

    @property
    def mlp_hidden(self) -> int:
        """MLP inner size: ``ffn_hidden``, else 4·d for GELU and Llama's 2/3·4·d rounded up to
        ``ffn_multiple`` for SwiGLU."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.activation != "swiglu":
            return 4 * self.d_model
        hidden = int(2 * 4 * self.d_model / 3)
        return -(-hidden // self.ffn_multiple) * self.ffn_multiple


@dataclass(frozen=True)
class ParallelConfig:
    tensor: int = 1
    """Tensor-parallel size: attention heads, MLP columns and the vocabulary are split over this
    many ranks (Megatron-style; keep it within a node)."""
    pipeline: int = 1
    """Pipeline-parallel size: the layers are cut into this many stages, trained by DeepSpeed's
    pipeline engine (1F1B over the micro-batches of a step)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs ``tensor`` > 1): norms, dropout and residuals run on
    a 1/tensor slice of the sequence; all-gather / reduce-scatter replace the all-reduces."""
    ulysses: int = 1
    """DeepSpeed-Ulysses sequence-parallel size: each rank holds 1/ulysses of every sequence and
    attention is computed head-parallel after an all-to-all (for long contexts)."""
    context: int = 1
    """Context-parallel size (ring attention, Megatron's ``--context-parallel-size``): the
    sequence is cut into 2 × context chunks, rank r holding chunks r and 2·context−1−r (equal
    causal work), and keys and values travel around the ring. Not capped by the head count;
    with ``ulysses`` too (USP) the all-to-all runs inside each ring rank's group."""
    pipeline_partition: str = choice("parameters", "uniform", "type:Block")
    """How layers are spread over pipeline stages: balanced by parameter count, the same number
    of layers per stage, or the same number of transformer blocks per stage."""
    zero_stage: int = choice(0, 1, 2, 3)
    """DeepSpeed ZeRO stage for the data-parallel dimension (the pipeline engine allows 0 and 1)."""
    hsdp: bool = False
    """Hybrid sharding (FSDP's HYBRID_SHARD, as IBM trained 7B models): ZeRO-3 within shard
    groups of ``hsdp_shard_size`` ranks (weights, gradients and optimizer state sharded there,
    parameter gathers inside the group) and data-parallel replicas of the shard group across
    them. Per step the only traffic between shard groups is each rank's gradient shard averaged
    over its replica group. Needs ``zero_stage`` 3 or 0 and ``ulysses`` 1."""
    hsdp_shard_size: Optional[int] = None
    """Ranks in one HSDP shard group; null means the ranks of one node."""
    offload_optimizer: str = choice("none", "cpu", "nvme")
    """ZeRO-Offload: where the fp32 master weights and Adam moments live and the update runs.
    ``cpu``: host memory, updated by DeepSpeed's CPU Adam (needs ``zero_stage`` ≥ 1); ``nvme``:
    files under ``nvme_path``, streamed through host memory (ZeRO-Infinity; ``zero_stage`` 3
    and DeepSpeed's async-I/O op, which needs libaio)."""
    offload_params: str = choice("none", "cpu", "nvme")
    """ZeRO-3 only: where the (sharded) parameters wait between uses: host memory or files
    under ``nvme_path``; each layer's are brought to the device when it runs."""
    nvme_path: Optional[str] = None
    """A directory on a fast node-local disk for ``nvme`` offload (each rank writes its own
    files there)."""
    tile_factor: int = 1
    """Memory-centric tiling (ZeRO-3 only): every block linear is cut into tile_factor ×
    tile_factor tiles, each its own parameter, so ZeRO-3 gathers one tile at a time and a layer
    larger than a device's free memory still fits; the result is the same. Costs speed: use the
    smallest factor that fits (``--plan`` counts it)."""

    @property
    def deepspeed_zero_stage(self) -> int:
        """The ZeRO stage DeepSpeed runs: HSDP is ZeRO-3."""
        return 3 if self.hsdp else self.zero_stage


@dataclass(frozen=True)
class DistributedConfig:
    timeout_minutes: float = 10.0
    """How long any collective may wait for the other ranks before the run stops with an error
    naming it (every rank exits non-zero; with NCCL/HCCL the watchdog aborts the process). Given
    to every process group, DeepSpeed's included. Megatron-LM's default; raise it for runs whose
    ranks legitimately wait longer between collectives (a slow first ``torch.compile``)."""
    setup_timeout_minutes: float = 60.0
    """How long the other ranks wait while one rank builds the dataset and its indices (a large
    corpus takes minutes), instead of ``timeout_minutes``."""
    hang_dump_after: float = 0.5
    """When a rank has waited in one collective for this fraction of its timeout, every rank
    writes where it is (the collective it is in, its Python stacks; on NCCL the flight recorder)
    under ``logging.dir/hang/``, before the timeout ends the run; ``tools/hang_report.py`` then
    names the ranks that are missing. So does a rank that has not moved (no step, no collective
    of the project) for that long, and at least 2 minutes: a wait inside DeepSpeed's own
    collectives. A rank sent SIGUSR2 does the same. 0: never (SIGUSR2 is then ignored). From
    0.05 to 0.9."""
    master_addr: Optional[str] = None
    """The rendezvous host for launchers that do not name one (``launch/ray_train.py``): the
    first rank listens there, so it is used only when it is an address of the node Ray placed
    the first rank on (otherwise a warning, and the default below). Null: ``MASTER_ADDR`` from
    the environment under the same check, else loopback when the whole job is on one node, else
    the address the first worker's Ray node registered with the cluster. Other launchers set
    ``MASTER_ADDR`` themselves (torchrun, ``launch/polaris.sh``, ``launch/gaudi.sh``)."""


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.1
    """AdamW weight decay on weight matrices and embeddings (never on norms or biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""


@dataclass(frozen=True)
class ScheduleConfig:
    warmup_iters: int = 0
    """Linear warm-up steps from 0 to ``optimizer.lr``."""
    decay_style: str = choice("cosine", "linear", "constant", "wsd")
    """Shape of the decay from ``optimizer.lr`` to ``optimizer.min_lr``: over all the steps
    after warm-up (``cosine``, ``linear``), none (``constant``), or ``wsd`` (warmup-stable-decay:
    MiniCPM's, Megatron-LM's ``WSD``, torchtitan's): ``optimizer.lr`` held, then a cooldown to
    ``min_lr`` over the last ``decay_fraction`` of those steps, shaped by ``decay_shape``. A run
    stopped before its cooldown can go on longer by raising ``training.iters``."""
    decay_iters: Optional[int] = None
    """Step at which the decay reaches ``min_lr``; null means the end of training."""
    decay_fraction: float = 0.2
    """With ``decay_style: wsd``: the share of the steps from the end of warm-up to the decay end
    spent in the cooldown (torchtitan's ``decay_ratio``; Megatron-LM gives it as
    ``--lr-wsd-decay-iters``)."""
    decay_shape: str = choice("linear", "cosine", "sqrt", "minus_sqrt")
    """With ``decay_style: wsd``: the cooldown's shape over its progress p from 0 to 1: the rate's
    share of ``lr − min_lr`` is 1 − p (``linear``), (1 + cos πp)/2 (``cosine``) or 1 − √p
    (``sqrt``: torchtitan's name, the "1-sqrt" cooldown of Hägele et al. 2024; ``minus_sqrt`` is
    Megatron-LM's name for the same)."""
    on_resume: str = choice("check", "checkpoint", "recipe")
    """When a resumed checkpoint's schedule (``optimizer.lr``/``min_lr``, these keys, the decay
    end) differs from the recipe's: ``check`` refuses to start and lists the differences;
    ``checkpoint`` continues the checkpoint's schedule; ``recipe`` follows the recipe's from the
    resumed step on (the rate may jump). Never a mix of the two."""


@dataclass(frozen=True)
class TrainingConfig:
    iters: Optional[int] = None
    """Optimizer steps to train for (give this or ``train_tokens``)."""
    train_tokens: Optional[int] = None
    """Token budget; converted to steps as ``ceil(train_tokens / (global_batch_size·seq_length))``."""
    micro_batch_size: int = 1
    """Samples per rank per forward pass."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all data-parallel ranks; null means micro_batch_size·dp
    (no accumulation). Must be a multiple of micro_batch_size·dp."""
    rampup_batch_size: Optional[list[int]] = None
    """``[start, increment, samples]``: ramp the global batch up from ``start`` to
    ``global_batch_size`` in steps of ``increment`` spread evenly over the first ``samples``
    samples (Megatron-LM's ``--rampup-batch-size``; the gradient-accumulation steps change, the
    micro-batch does not). The learning rate follows samples: ``schedule`` steps count full
    batches. Needs ``train_tokens`` (not ``iters``), as Megatron's needs sample-based training,
    and no pipeline parallelism; ``start`` and ``increment`` multiples of micro_batch_size·dp."""
    log_interval: int = 10
    """Steps between console/metrics lines."""
    eval_interval: int = 500
    """Steps between evaluations (also done at the end; 0 evaluates only at the end)."""
    eval_iters: int = 50
    """Validation batches (of global_batch_size samples) per evaluation."""
    seed: int = 1234
    """Seed of parameter initialisation and dropout."""
    device: str = choice("auto", "cpu", "cuda", "hpu", "xpu")
    """Accelerator; ``auto`` takes what DeepSpeed detects. ``xpu``: Intel GPUs (Aurora's Max
    1550 tiles, one rank each) through DeepSpeed's XPU accelerator, collectives over oneCCL
    (torch's ``xccl``, else ``oneccl_bindings_for_pytorch``'s ``ccl``)."""
    precision: str = choice("fp32", "bf16", "fp16")
    """Training precision (bf16/fp16 through DeepSpeed's mixed-precision engine)."""
    tf32: bool = True
    """On CUDA, let float32 matrix products and convolutions use TF32 tensor cores (10-bit
    mantissa inputs, fp32 accumulation: about 8x the plain fp32 rate on A100/H100). Only fp32
    parts use it: the whole model under ``precision: fp32``, and fp32 leftovers under bf16.
    ``false`` keeps full fp32 products. No effect on other devices."""
    cpu_retain_freed_memory: bool = True
    """On CPU (Linux, glibc), keep memory that tensors free inside the process for the next step
    instead of returning it to the kernel and faulting it in again (``mallopt``; the page faults
    are a visible share of a small model's step). The process keeps its peak memory until it
    exits. No effect on other devices or C libraries."""
    kernels: str = choice("torch", "liger")
    """Kernel of the output layer + loss. ``torch``: the chunked fused loss of ``model/loss.py``
    (every device; compiled with ``training.compile``). ``liger``: Liger Kernel's fused linear
    cross-entropy (Triton, CUDA only; ``pip install liger-kernel``), for the single-device output
    layer: not with ``parallel.tensor`` or ``parallel.pipeline`` above 1."""
    compile: bool = False
    """Compile each transformer block with ``torch.compile`` (the accelerator's backend: inductor
    on CPU/CUDA, ``hpu_backend`` on Gaudi). The first steps pay the compilation (seconds to a
    minute); later ones run fused elementwise kernels. Works with every layout and with
    activation checkpointing."""
    hpu_mode: str = choice("lazy", "eager", "compile")
    """Intel Gaudi execution mode: ``lazy`` graph mode (``PT_HPU_LAZY_MODE=1``; the graph is cut
    after backward and after the optimizer step), ``eager``, or eager with ``torch.compile`` on
    the HPU backend. Ignored on other devices."""
    sample_prompt: str = "\n"
    """Prompt of the text sample generated at each evaluation (empty disables sampling)."""
    sample_tokens: int = 200
    """Tokens generated for the sample (through a KV cache; past the model's context the window
    starts again from its last three quarters)."""
    sample_temperature: float = 0.8
    """Sampling temperature (0 is greedy)."""
    sample_top_k: int = 200
    """Sample among the top-k tokens (0 keeps all)."""
    exit_duration_mins: Optional[float] = None
    """Save a checkpoint and exit 0 once the run has been going this many minutes (set it a few
    minutes under the job's walltime), counted from the launcher's start where it exports
    ``LAUNCH_START_EPOCH`` (launch/polaris.sh), else from the process's; null: no limit. Without
    ``checkpoint.dir`` the stop saves nothing and exits 1 (no later job could continue)."""
    throughput_warmup_steps: int = 2
    """The first steps of each start of the process (compilation, allocator and optimizer-state
    warm-up) that tokens/s, samples/s, TFLOP/s and MFU leave out; a record whose steps are all
    warm-up has them null. Step times include them."""


@dataclass(frozen=True)
class CheckpointConfig:
    dir: Optional[str] = None
    """Where checkpoints go; null disables saving and resuming."""
    save_interval: int = 0
    """Steps between saves (0: only at the end, when ``dir`` is set)."""
    resume: bool = True
    """Resume from the latest checkpoint in ``dir`` when there is one."""
    init_from: Optional[str] = None
    """Start from the weights of another model: a checkpoint of this project (a step directory,
    or a ``checkpoint.dir`` whose ``latest`` names one) or a Hugging Face model directory (Llama,
    Qwen2, Qwen3, GPT-2). Weights only: step 0, a fresh optimizer and schedule, data from the start; any
    layout. The recipe's model must fit the weights (every mismatching parameter or field is
    refused at once); RoPE's base and scaling may differ (a context extension). In bf16/fp16 the
    weights start rounded to that precision (DeepSpeed's fp32 master copies are made from them).
    A run that has its own checkpoint in ``dir`` resumes from it and ignores this (said in the
    log)."""
    keep_last: int = 3
    """Keep the newest this many checkpoints (0: keep all); older ones are deleted only after a
    newer one is committed."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0: none)."""
    load_fallback: bool = False
    """When the checkpoint ``latest`` names is corrupt or incomplete (or ``latest`` itself is),
    resume from the newest valid one instead of stopping with the error."""
    strict_model: bool = True
    """Refuse to load a checkpoint written for a different model shape, vocabulary or sequence
    length (the error lists the differences)."""
    save_interval_minutes: float = 0.0
    """Also save when this many minutes have passed since the last save (0: off)."""
    save_on_signal: bool = True
    """On SIGTERM or SIGUSR1 (PBS sends one before walltime) every rank agrees on a step, saves
    and exits 0."""
    on_save_failure: str = choice("stop", "continue")
    """After a failed save (disk full, I/O error on any rank): ``stop`` exits non-zero after
    ``max_save_failures`` consecutive failures; ``continue`` trains on and warns at every log
    step how old the last good checkpoint is. Under both, a last step that cannot be saved ends
    the run non-zero, unfinished: the same command resumes from the last good checkpoint."""
    max_save_failures: int = 1
    """Consecutive failed saves that stop the run under ``on_save_failure: stop``."""
    async_save: bool = False
    """Write checkpoints in a background thread: training is blocked only while the state is
    copied to host memory. At most one save is in flight; the next save and the end of the run
    wait for it, and its failure is handled like a failed synchronous save."""
    check_free_space: bool = True
    """Before writing, compare the checkpoint's size with the free space of ``dir`` and fail the
    save cleanly if it does not fit (turn off where the filesystem misreports free space)."""


@dataclass(frozen=True)
class RollbackConfig:
    min_steps_back: int = 1
    """Reload the newest committed checkpoint at least this many steps before the spiking step
    (checkpoints closer to the spike may already carry its cause)."""
    skip_batches: int = 200
    """Global batches skipped after the spiking one (PaLM skipped 200–500); the data from the
    reloaded checkpoint's position through the spike is skipped too."""
    max_rollbacks: int = 5
    """Rollbacks allowed in the whole run; the next one stops the run with an error."""


@dataclass(frozen=True)
class SpikesConfig:
    policy: str = choice("log", "skip_step", "rollback")
    """What a loss or gradient-norm spike does: ``log`` records it; ``skip_step`` leaves the
    parameters and optimizer state untouched for that step (the LR schedule and the data
    position still advance); ``rollback`` reloads an earlier checkpoint and skips the data
    window that led to the spike (``spikes.rollback``)."""
    nonfinite_policy: str = choice("skip_step", "rollback")
    """What a NaN/Inf loss or gradient (on any rank) does; it is never applied."""
    max_consecutive_nonfinite: int = 5
    """Stop the run after this many non-finite steps in a row."""
    window: int = 100
    """Steps in the running window of losses and gradient norms (median and MAD)."""
    warmup_steps: int = 20
    """Finite steps observed before detection starts (the first losses fall too fast to judge)."""
    loss_z: float = 6.0
    """A loss is a spike when it is this many robust standard deviations (1.4826·MAD) above the
    window's median ...; 0 turns loss detection off."""
    loss_ratio: float = 1.05
    """... and at least this factor above the median (keeps a flat window from flagging noise)."""
    grad_norm_z: float = 6.0
    """Like ``loss_z`` for the gradient norm before clipping; 0 turns it off."""
    grad_norm_ratio: float = 2.0
    """Like ``loss_ratio`` for the gradient norm."""
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    """Where ``rollback`` goes back to and how much data it skips."""


@dataclass(frozen=True)
class LoggingConfig:
    dir: str = "runs/default"
    """Run directory: receives ``config.yaml``, ``metrics.jsonl`` and the TensorBoard events."""
    tensorboard: bool = True
    """Write TensorBoard events into ``dir``."""
    wandb_mode: str = choice("disabled", "offline", "online")
    """Weights & Biases: off, offline files in ``dir/wandb`` (no network), or online."""
    wandb_project: str = "megatron_lite"
    """Weights & Biases project name."""
    run_name: Optional[str] = None
    """Run name for W&B; null uses the run directory's name."""
    all_ranks: bool = False
    """Every rank prints its console lines, each prefixed with ``[rank R]`` (debugging a
    layout); by default only rank 0 prints."""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B tags of the run (filters in the W&B interface)."""
    wandb_group: Optional[str] = None
    """W&B group: runs that belong together (a sweep, the stages of one model)."""


@dataclass(frozen=True)
class ProfileConfig:
    steps: list[int] = field(default_factory=list)
    """``[start, end]``: record steps start to end (inclusive, counted from 1) with
    torch.profiler and write the trace when step ``end`` is done. Empty: no profiling."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """The ranks that record (each writes its own trace)."""
    dir: Optional[str] = None
    """Where the traces go (``rank{R}.*.pt.trace.json``: Chrome/Perfetto trace and TensorBoard's
    profiler plugin); null: ``logging.dir/profile``."""


@dataclass(frozen=True)
class MonitorConfig:
    slowdown_factor: float = 1.5
    """A log interval whose time per step is this many times the rolling median of the previous
    intervals is a ``slowdown`` event naming the phase (data, forward, backward, optimizer) that
    grew most; 0 turns it off."""
    window: int = 20
    """Log intervals in the rolling median (warm-up intervals and slowdowns are left out)."""
    min_history: int = 5
    """Intervals the median needs before the first slowdown can be named."""
    straggler_interval: int = 100
    """Every this many steps (at the first log step at or after each multiple) every rank's
    local time per step (data wait plus forward, the work before the first gradient exchange)
    is gathered over the control group; 0 turns it off."""
    straggler_factor: float = 1.3
    """A rank whose local time per step is this many times the median of the other ranks' is a
    ``straggler`` event naming its rank and host."""
    min_excess: float = 0.05
    """Neither event fires for an excess below this fraction of the median step time (timer
    noise on fast steps)."""


@dataclass(frozen=True)
class EvalConfig:
    harness_tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks (or groups) scored on the model during training, at
    ``harness_interval`` and the last step; the scores go to the metrics as
    ``harness/TASK/METRIC`` (metrics.jsonl, TensorBoard, W&B, the console). Needs ``pip install
    'megatron_lite[eval]'`` and the whole model on every rank (no pipeline, Ulysses, context or
    sequence parallelism)."""
    harness_interval: int = 0
    """Steps between task scorings (0: the last step only)."""
    harness_limit: Optional[int] = None
    """At most this many documents per task (null: all)."""
    harness_include_path: Optional[str] = None
    """A folder of lm-eval task YAML files of your own (a task over a local jsonl file works
    without the network)."""
    harness_batch_size: int = 8
    """Requests per forward pass."""


@dataclass(frozen=True)
class Config:
    base: Optional[str] = None
    """Recipe this one extends (a path relative to this recipe's file); its keys are overridden."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset and tokenizer."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout (data parallelism is the world size divided by the others)."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Process groups: collective timeouts."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW settings."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Loop, batch and budget."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    spikes: SpikesConfig = field(default_factory=SpikesConfig)
    """Loss-spike and non-finite step detection, provenance and policies."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Run directory and loggers."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """torch.profiler traces of chosen steps on chosen ranks (CPU, CUDA, HPU)."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """Slowdown and straggler detection from the phase timings of training records."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Downstream tasks (lm-evaluation-harness) during training."""
    deepspeed: dict[str, Any] = field(default_factory=dict)
    """Extra DeepSpeed config keys, deep-merged over the generated config. A key the recipe
    already states elsewhere (batch sizes, gradient_clipping, zero_optimization.stage, bf16/fp16
    enabled, optimizer, scheduler) must agree with it, or the run is refused before any work.
    Sections DeepSpeed reads as mappings (zero_optimization, bf16, fp16, pipeline, ...) must be
    mappings here too: deepspeed.zero_optimization.overlap_comm=true, not
    deepspeed.zero_optimization=false."""
    tags: list[str] = field(default_factory=list)
    """Free-form labels recorded with the run."""
