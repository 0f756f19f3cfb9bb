"""kiln.run.source: a run's newest checkpoint, one named checkpoint, or hf:DIR, loaded into one small object; the
names that cannot be loaded are one SourceError naming the path."""
import json
import shutil

import pytest
import torch

from kiln.run.source import SourceError, load_source


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus_file, kiln_cache):
    """A 4-step run with checkpoints at steps 2 and 4 and a 300-token BPE tokenizer."""
    from kiln.config import make_config
    from kiln.data import DataConfig
    from kiln.run.lm import train
    from tests.conftest import small_model

    path = tmp_path_factory.mktemp("source") / "run"
    cfg = make_config(model=small_model(), data=DataConfig(source=str(corpus_file), seq_len=32, tokenizer="bpe",
                                                           vocab_size=300, cache_dir=str(kiln_cache)))
    cfg.train.max_steps, cfg.train.micro_batch_size, cfg.train.eval_batches = 4, 4, 2
    cfg.train.sample_tokens, cfg.train.device, cfg.checkpoint.interval = 0, "cpu", 2
    cfg.precision.mode, cfg.log.tensorboard, cfg.log.progress = "fp32", False, "off"
    train(cfg, path)
    return path


def test_a_run_loads_its_newest_checkpoint_and_a_named_one(run_dir):
    latest = load_source(run_dir, device="cpu")
    assert latest.step == 4 and not latest.model.training and latest.tokenizer.kind == "bpe"
    assert latest.eot_id == latest.tokenizer.eot_id and latest.eos_ids == (latest.eot_id,)
    assert latest.max_seq_len == 64 and latest.model_cfg.vocab_size == latest.tokenizer.vocab_size
    assert latest.description.startswith(f"{run_dir} step 4 (gpt2, ")
    first = load_source(run_dir / "checkpoints" / "step_000002", device="cpu")
    assert first.step == 2
    saved = torch.load(run_dir / "checkpoints" / "step_000002" / "state.pt", weights_only=True)["model"]
    assert all(torch.equal(v, saved[k]) for k, v in first.model.state_dict().items())
    ids = torch.tensor([latest.tokenizer.encode("def f(x):")])
    assert not torch.equal(first.model(ids), latest.model(ids))  # two steps of training apart


def test_an_hf_directory_loads_with_every_eos_id(tmp_path, corpus_file):
    transformers = pytest.importorskip("transformers")
    from kiln.data.tokenizer import BPETokenizer

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=48,
                                                              vocab_size=301, eos_token_id=[0, 7]))
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 0]}))
    BPETokenizer.train([corpus_file.read_text()[:30000]], 301).save(tmp_path / "hf")
    source = load_source(f"hf:{tmp_path / 'hf'}", device="cpu")
    assert source.step is None and source.eot_id == 0 and source.eos_ids == (0, 5, 7)
    assert source.max_seq_len == 48 and source.description.startswith(f"hf:{tmp_path / 'hf'} (gpt2, ")
    ids = torch.randint(0, 301, (1, 12))
    with torch.no_grad():
        assert (source.model(ids)[..., :301] - hf.eval()(ids).logits).abs().max().item() <= 1e-5


def test_names_that_cannot_be_loaded_are_one_line_naming_the_path(run_dir, tmp_path):
    missing = run_dir / "checkpoints" / "step_000003"
    with pytest.raises(SourceError, match=r"^\S+step_000003: no such checkpoint; the run has step_000002, "
                                          r"step_000004 \(`kiln checkpoints "):
        load_source(missing, device="cpu")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(run_dir / "config.toml", fresh / "config.toml")
    with pytest.raises(SourceError, match=f"^{fresh} has no checkpoint: the run saved none yet"):
        load_source(fresh, device="cpu")
    with pytest.raises(SourceError, match=f"^{tmp_path}: has no config.toml; pass a run directory"):
        load_source(tmp_path, device="cpu")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 1,
                                                             "n_embd": 8, "n_positions": 8, "vocab_size": 256}))
    with pytest.raises(SourceError, match=f"^{tmp_path / 'hf'} holds neither model.safetensors"):
        load_source(f"hf:{tmp_path / 'hf'}", device="cpu")
    with pytest.raises(SourceError, match=f"^{tmp_path / 'nope'}: does not exist; hf:DIR names"):
        load_source(f"hf:{tmp_path / 'nope'}", device="cpu")


def test_an_hf_directory_without_a_tokenizer_reads_bytes_only_at_256_tokens(tmp_path):
    """`kiln export` of a bytes run writes no tokenizer file: 256 tokens read as bytes; any other size is refused."""
    from kiln.interop.hf import write_hf
    from kiln.models import build_model
    from tests.conftest import small_model

    for vocab in (256, 300):
        cfg = small_model(vocab_size=vocab).resolve()
        write_hf(cfg, build_model(cfg).state_dict(), vocab, tmp_path / str(vocab), eos=255)
    source = load_source(f"hf:{tmp_path / '256'}", device="cpu")
    assert source.tokenizer.kind == "bytes" and source.eos_ids == (255,)
    with pytest.raises(SourceError, match=f"^{tmp_path / '300'}: has no tokenizer.json; copy the model's"):
        load_source(f"hf:{tmp_path / '300'}", device="cpu")
