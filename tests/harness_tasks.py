"""What the downstream-evaluation tests share: a small random Llama-3 and a byte-level BPE
tokenizer built offline, local lm-eval tasks over jsonl files, and lm-eval's own Hugging Face
model's results on them (the reference every score is compared with)."""

from __future__ import annotations

import json
import textwrap

import torch

MAX_LEN = 64  # short enough that some contexts and documents are truncated and windowed
WORDS = ("the cat sat on a mat . a dog ran to the park and the bird sang in a tree . "
         "one two three four five six seven eight nine ten red green blue sun moon star").split()
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def _sentence(rng: torch.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=rng).tolist())


def save_tokenizer(out) -> None:
    """A byte-level BPE (GPT-2's kind: a word's leading space is part of its token) that adds
    BOS itself, as Llama's does, built offline from the words above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Only the bytes the words use: a random model then writes words, not stray bytes.
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1), ("</s>", 2)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(out)


def save_llama(out, vocab: int) -> None:
    """A small random Llama (GQA, llama3 RoPE scaling), weights perturbed so that norms are not
    ones and the scores spread."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
                      rms_norm_eps=1e-6, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(out)


def write_tasks(d, rng: torch.Generator, gen_targets: list[str] | None = None) -> None:
    """Three local tasks over jsonl files: multiple choice (acc, acc_norm; an empty context, a
    context ending in spaces, one longer than the model, one starting with the BOS text),
    generation (exact_match; a prompt longer than the model) and perplexity (a document of
    several windows)."""
    mc = [{"question": _sentence(rng, 6), "choices": [_sentence(rng, k) for k in (1, 2, 3)],
           "answer": i % 3} for i in range(6)]
    mc[1]["question"] = ""
    mc[2]["question"] += "  "
    mc[3]["question"] = _sentence(rng, 90)
    mc[4]["question"] = "<s>" + mc[4]["question"]  # no second BOS, as HFLM
    gen = [{"prompt": _sentence(rng, 5), "target": "?"} for _ in range(5)]
    gen[4]["prompt"] = _sentence(rng, 80)
    for doc, target in zip(gen, gen_targets or [], strict=False):
        doc["target"] = target
    ppl = [{"text": _sentence(rng, n)} for n in (5, 12, 120)]
    for name, docs in (("mc", mc), ("gen", gen), ("ppl", ppl)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    head = "task: tiny_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\n" \
           "test_split: test\n"
    (d / "tiny_mc.yaml").write_text(head.format(name="mc", path=d / "mc.jsonl") + textwrap.dedent("""\
        output_type: multiple_choice
        doc_to_text: "{{question}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{answer}}"
        metric_list: [{metric: acc}, {metric: acc_norm}]
        """))
    (d / "tiny_gen.yaml").write_text(head.format(name="gen", path=d / "gen.jsonl") + textwrap.dedent("""\
        output_type: generate_until
        doc_to_text: "{{prompt}}"
        doc_to_target: "{{target}}"
        generation_kwargs: {until: ["e", "."], max_gen_toks: 8, do_sample: false}
        metric_list: [{metric: exact_match}]
        """))
    (d / "tiny_ppl.yaml").write_text(head.format(name="ppl", path=d / "ppl.jsonl") + textwrap.dedent("""\
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, {metric: bits_per_byte}]
        """))


TASKS = ["tiny_mc", "tiny_gen", "tiny_ppl"]


def hflm_results(hf_dir, tasks_dir, tasks: list[str]) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(hf_dir), device="cpu", batch_size=1, dtype="float32")
    return simple_evaluate(model=lm, tasks=tasks, bootstrap_iters=0, log_samples=True,
                           task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False))
