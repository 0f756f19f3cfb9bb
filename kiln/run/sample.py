"""`kiln sample`: text from a trained model (a run's newest checkpoint, one checkpoint, or hf:DIR: kiln.run.source)
for one prompt or a JSONL file of them, as plain text or as a chat through the model's template.

    prompts = read_prompt_file(FILE)              [{"prompt": ...} | {"messages": [...]}, ...] (FILE:LINE errors)
    template = find_chat_template(spec)          the model's chat template, or None
    ids = encode_prompt(tokenizer, row, chat, template, tokens)
    sample_from_run(RUN, prompt, n, temperature, top_k)   one prompt's text (the library call)
"""
from __future__ import annotations

from pathlib import Path

from kiln.config import load_config
from kiln.data.chat import chat_template, check_messages, render, special_tokens
from kiln.data.jsonl import JsonlError, jsonl_rows
from kiln.errors import KilnError
from kiln.run.lm import generate_text
from kiln.run.source import HF_PREFIX, STEP_DIR, load_source


def load_model(run_dir: Path, device: str = "auto"):
    """The model (eval mode) and tokenizer of a run's latest checkpoint (or of RUN_DIR/checkpoints/step_N, hf:DIR:
    kiln.run.source), and its device."""
    source = load_source(run_dir, device)
    return source.model, source.tokenizer, source.device


def sample_from_run(run_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int,
                    seed: int = 0, device: str = "auto") -> str:
    model, tokenizer, dev = load_model(run_dir, device)
    return generate_text(model, tokenizer, prompt, max_new_tokens, temperature, top_k or None, seed, dev)


def read_prompt_file(path: Path) -> list[dict]:
    """The rows of a JSONL prompt file: objects with "prompt" (a string) or "messages" (a conversation)."""
    path = Path(path)
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KilnError(f"{path} is not UTF-8 text; a prompt file holds one JSON object per line",
                        key=str(path),
                        fix="a prompt file holds one JSON object per line") from None
    for n, row in jsonl_rows(text, path, skip_bad=True):
        where = f"{path}:{n}"
        if isinstance(row, JsonlError):
            raise KilnError(f"{where}: not a JSON object ({row.reason}); write one object per line",
                            key=where, fix="write one object per line")
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            rows.append(row)
        elif isinstance(row, dict) and "messages" in row:
            check_messages(row["messages"], where)
            rows.append(row)
        else:
            raise KilnError(f"{where}: needs \"prompt\" (a string) or \"messages\" (a list of {{\"role\": ..., "
                            f"\"content\": ...}})",
                            key=where, fix="needs \"prompt\" (a string) or \"messages\"")
    if not rows:
        raise KilnError(f"{path} holds no prompts; write one JSON object per line",
                        key=str(path), fix="write one JSON object per line")
    return rows


def find_chat_template(spec: str, template_file: str | None = None) -> tuple[str | None, dict[str, str], str]:
    """(template or None, its special tokens, where it was looked for) for the model `spec` names: --chat-template
    FILE, else hf:DIR's own, else a run's (its directory, then the hf: directories its config names as
    data.tokenizer or model.init)."""
    if template_file:
        return Path(template_file).read_text(encoding="utf-8"), {}, template_file
    if spec.startswith(HF_PREFIX):
        places = [Path(spec[len(HF_PREFIX):])]
    else:
        run = Path(spec)
        run = run.parent.parent if STEP_DIR.fullmatch(run.name) and run.parent.name == "checkpoints" else run
        cfg = load_config(run / "config.toml")
        places = [run] + [Path(v[len(HF_PREFIX):]) for v in (cfg.data.tokenizer, cfg.model.init)
                          if v.startswith(HF_PREFIX)]
    for place in places:
        template = chat_template(place)
        if template is not None:
            return template, special_tokens(place), str(place)
    return None, {}, " or ".join(str(p) for p in places)


def encode_prompt(tokenizer, row: dict, chat: bool, template: str | None, tokens: dict, where: str) -> list[int]:
    """A prompt row's token ids: its text, or (messages, or --chat) the conversation rendered by the template and
    ended with the assistant's header. An empty prompt is the end-of-text id: the start of a document."""
    messages = row.get("messages")
    if messages is None and chat:
        messages = [{"role": "user", "content": row["prompt"]}]
    if messages is None:
        ids = tokenizer.encode(row["prompt"])
    else:
        if template is None:
            raise KilnError(f"{where} has no chat template (chat_template.jinja, or \"chat_template\" in "
                            f"tokenizer_config.json) to render messages with; give one with --chat-template FILE",
                            key="--chat-template", value=where, fix="give one with --chat-template FILE")
        ids = tokenizer.encode_chat(render(messages, template, tokens, add_generation_prompt=True))
    return ids or [max(tokenizer.eot_id, 0)]
