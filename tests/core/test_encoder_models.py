"""BERT / XLM-RoBERTa encoders and cross-encoders (kiln.models.bert) built through Kiln's builder
against Hugging Face transformers on the same tiny random weights: several prompts of different
lengths in one flattened step, BERT segment ids, classification heads, checkpoint names with and
without the task models' prefix, tensor parallelism, and what is refused."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from kiln.testing.encoders import PROMPTS, TOKEN_TYPES, assert_matches_transformers, encoder_runner, run_encoder_step

MODELS = {
    "bert": ("bert", {}),
    "bert-classifier": ("bert", dict(architectures="BertForSequenceClassification", num_labels=3)),
    "xlm-roberta": ("xlm-roberta", {}),
    "xlm-roberta-classifier": (
        "xlm-roberta",
        dict(architectures="XLMRobertaForSequenceClassification", num_labels=1),
    ),
    "roberta": ("roberta", {}),
}


def model_dir(tiny_model_dir, name: str) -> str:
    model_type, overrides = MODELS[name]
    return tiny_model_dir(model_type, **overrides)


@pytest.mark.parametrize("name", MODELS)
def test_matches_transformers_with_the_reference_backend(tiny_model_dir, cpu_plugins, name):
    path = model_dir(tiny_model_dir, name)
    runner = encoder_runner(cpu_plugins, path, device="cpu", dtype="float32", attention_backend="torch_ref")
    assert runner.model.is_encoder and len(runner.model.layers) == 0
    assert runner.graphs is None  # encoders never run as decode graphs
    types = TOKEN_TYPES if name.startswith("bert") else None
    assert_matches_transformers(runner, path, PROMPTS, types)


def test_the_runner_passes_the_layout(tiny_model_dir, cpu_plugins):
    """``ModelRunner.run_batch`` (the engine's path) gives the encoder the step's layout."""
    from kiln.worker.model_runner import StepBatch

    path = model_dir(tiny_model_dir, "bert")
    runner = encoder_runner(cpu_plugins, path, device="cpu", dtype="float32")
    lens = [len(p) for p in PROMPTS]
    rows = [[1 + i] * -(-n // runner.block_size) for i, n in enumerate(lens)]  # never read
    batch = StepBatch(sum(PROMPTS, []), [i for n in lens for i in range(n)], rows, [0] * len(lens), lens)
    with torch.inference_mode():
        hidden = runner.run_batch(batch)
    torch.testing.assert_close(hidden, run_encoder_step(runner, PROMPTS), atol=0, rtol=0)


@pytest.mark.parametrize("name", ["bert", "xlm-roberta-classifier"])
def test_checkpoint_names_with_and_without_the_prefix(tiny_model_dir, name):
    """sentence-transformers saves the bare encoder; the task models nest it under ``bert.`` /
    ``roberta.``: both load to the same weights."""
    from transformers import AutoConfig

    from kiln.attention.torch_ref import TorchRefAttentionBackend
    from kiln.builtin_plugin import ENCODERS
    from kiln.interfaces.model import resolve_ops
    from kiln.models import bert
    from kiln.models.loader import iter_weights

    path = model_dir(tiny_model_dir, name)
    cfg = AutoConfig.from_pretrained(path)
    heads, dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    cls = getattr(bert, ENCODERS[cfg.architectures[0]])
    model, other = (
        cls(cfg, resolve_ops({}), TorchRefAttentionBackend(heads, heads, dim, torch.float32), 512) for _ in "ab"
    )
    weights = dict(iter_weights(path))
    prefix = model.checkpoint_prefix
    assert any(n.startswith(prefix) for n in weights) != (name == "bert")
    flipped = {n.removeprefix(prefix) if n.startswith(prefix) else prefix + n: t for n, t in weights.items()}
    model.load_weights(weights.items())
    other.load_weights(flipped.items())
    for n, p in model.state_dict().items():
        torch.testing.assert_close(other.state_dict()[n], p, atol=0, rtol=0)
    with pytest.raises(ValueError, match="missing weights"):
        model.load_weights((n, t) for n, t in flipped.items() if "value" not in n)
    with pytest.raises(ValueError, match="unexpected weight 'lm_head.weight'"):
        model.load_weights([*flipped.items(), ("lm_head.weight", torch.zeros(1))])


def test_refuses_what_it_cannot_run(tiny_model_dir, cpu_plugins):
    path = model_dir(tiny_model_dir, "xlm-roberta")
    with pytest.raises(ValueError, match="--max-model-len: 514 exceeds the 512 positions"):
        encoder_runner(cpu_plugins, path, device="cpu", max_model_len=514)
    with pytest.raises(ValueError, match="--quantization weight_only_int8: .* has no quantized layers"):
        encoder_runner(cpu_plugins, path, device="cpu", quantization="weight_only_int8")
    path = tiny_model_dir("bert", position_embedding_type="relative_key")
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key' is not supported"):
        encoder_runner(cpu_plugins, path, device="cpu")


def _tp_rank(rank: int, path: str, init: str, results) -> None:
    """Rank ``rank`` of 2: its half of the heads and of the MLP, the reference backend."""
    from transformers import AutoConfig

    from kiln.attention.torch_ref import TorchRefAttentionBackend
    from kiln.distributed import TensorParallel
    from kiln.interfaces.attention import BatchLayout
    from kiln.interfaces.model import StepContext, resolve_ops
    from kiln.models.bert import BertForSequenceClassification
    from kiln.models.loader import iter_weights

    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    cfg = AutoConfig.from_pretrained(path)
    backend = TorchRefAttentionBackend(1, 1, 32, torch.float32)  # 2 heads of 32, one per rank
    model = BertForSequenceClassification(cfg, resolve_ops({}), backend, 512, TensorParallel(rank, 2))
    model.load_weights(iter_weights(path))
    lens = [len(p) for p in PROMPTS]
    layout = BatchLayout.build([[1]] * len(lens), [0] * len(lens), lens, 64, "cpu")
    ids, positions = torch.tensor(sum(PROMPTS, [])), torch.tensor([i for n in lens for i in range(n)])
    with torch.inference_mode():
        hidden = model(ids, positions, StepContext(None, [], layout, torch.tensor(sum(TOKEN_TYPES, []))))
    results.put((rank, hidden.tolist()))  # plain values: a tensor would be shared by a file descriptor
    torch.distributed.destroy_process_group()


def test_two_ranks_match_one(tiny_model_dir, cpu_plugins, tmp_path):
    path = model_dir(tiny_model_dir, "bert-classifier")
    runner = encoder_runner(cpu_plugins, path, device="cpu", dtype="float32", attention_backend="torch_ref")
    expected = run_encoder_step(runner, PROMPTS, TOKEN_TYPES)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    ranks = [ctx.Process(target=_tp_rank, args=(rank, path, init, results)) for rank in range(2)]
    for p in ranks:
        p.start()
    got = dict(results.get(timeout=120) for _ in ranks)
    for p in ranks:
        p.join(timeout=30)
    assert [p.exitcode for p in ranks] == [0, 0]
    for rank in (0, 1):
        torch.testing.assert_close(torch.tensor(got[rank]), expected, atol=1e-5, rtol=1e-5)
