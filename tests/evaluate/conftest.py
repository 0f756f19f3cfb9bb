import json

import pytest
import torch


@pytest.fixture(scope="session")
def exported(tmp_path_factory, corpus_file):
    """A random kiln GPT-2 (2 layers, 32-token window, vocabulary padded from 300 to 320) with a 300-token BPE
    tokenizer, exported as `kiln export` writes a Hugging Face directory."""
    from kiln.data.tokenizer import BPETokenizer
    from kiln.interop.hf import write_hf
    from kiln.models import build_model
    from tests.conftest import small_model

    directory = tmp_path_factory.mktemp("eval") / "hf"
    tokenizer = BPETokenizer.train([corpus_file.read_text()[:15000]], 300)
    cfg = small_model(vocab_size=tokenizer.vocab_size, max_seq_len=32).resolve()
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():  # larger than init's 0.02: log-likelihoods that differ clearly between choices
        for p in model.parameters():
            p.mul_(4.0)
    write_hf(cfg, model.state_dict(), tokenizer.vocab_size, directory, eos=tokenizer.eot_id)
    tokenizer.save(directory)
    eos = tokenizer.decode([tokenizer.eot_id])
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                 "eos_token": eos, "bos_token": eos}))
    return directory


@pytest.fixture(scope="session")
def hf(exported):
    """transformers' model (float64) and tokenizer of the export: the reference."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")
    return (transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float64).eval(),
            transformers.AutoTokenizer.from_pretrained(exported))
