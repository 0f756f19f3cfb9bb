"""`kiln doctor`: the pre-flight checklist, run on the configured model and data before a long run.

Each check measures one thing on the real model, data pipeline and train step, and reports pass / warn / fail
with the number it measured and a one-line fix. Checks that change the weights (overfitting one batch) run
last; the run is built in a temporary directory and thrown away.
"""
from __future__ import annotations

import copy
import math
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kiln.data import val_batches
from kiln.models import IGNORE_INDEX
from kiln.numerics.faults import FaultInjector
from kiln.numerics.monitor import clone_state
from kiln.run.lm import LMRun, build_lm
from kiln.train.step import evaluate, train_step

PASS, WARN, FAIL = "pass", "warn", "fail"
OVERFIT_SEQS, OVERFIT_TOKENS, OVERFIT_STEPS = 2, 64, 100  # 2×64 tokens: the tiny preset memorizes it in ~20 steps
INIT_STD = 0.02  # kiln's init scheme (GPT-2): N(0, 0.02); residual projections 0.02/sqrt(2·n_layer); norms 1

CHECKS = [  # (number, name, what it verifies): the order of the report
    (1, "init_loss", "loss at init ≈ ln(vocab): the model starts out uniformly unsure"),
    (2, "overfit_one_batch", "one small batch can be memorized: the model, loss and optimizer can learn"),
    (3, "gradient_flow", "every trainable parameter receives a finite, non-zero gradient"),
    (4, "targets_shifted", "targets are the inputs shifted by one, and every token id is < vocab"),
    (5, "data_finite", "no NaN/Inf in the data or the embedded inputs"),
    (6, "train_eval_mode", "train mode while training, eval mode while evaluating, train mode restored"),
    (7, "grads_cleared", "gradients are cleared between steps"),
    (8, "weight_std", "per-layer weight std matches the init scheme"),
    (9, "activations", "activations on one batch: finite, no dead units, no saturation, no growth with depth"),
    (10, "warmup", "learning-rate warmup for Adam-family optimizers"),
    (11, "grad_norm", "gradient norm at init in a healthy range"),
    (12, "utilisation", "the steps keep the device busy ≥ 85% of the time (not waiting for data)"),
]
BUSY_STEPS, BUSY_MIN = 5, 0.85


@dataclass
class Check:
    number: int
    name: str
    status: str  # pass | warn | fail
    value: str  # what was measured
    fix: str  # one line: what to change when it is not a pass

    def to_dict(self) -> dict:
        return asdict(self)


def _grade(x: float, ok: tuple[float, float], soft: tuple[float, float]) -> str:
    if ok[0] <= x <= ok[1]:
        return PASS
    return WARN if soft[0] <= x <= soft[1] else FAIL


class Doctor:
    """Runs the checklist on kiln's language-model job (kiln.run.lm.LMRun) built from the configuration."""

    def __init__(self, lm: LMRun, faults: FaultInjector | None):
        self.lm, self.state, self.faults = lm, lm.state, faults
        self.model = lm.state.model  # eager, even when train.compile is on: hooks go on the real modules
        self.device = lm.state.device
        x, y, *_ = lm.state.loader.next()  # a document mask's doc is left out: the checks are the model's own
        if faults is not None:
            faults.begin_step(0)  # step 0 never arms the step-keyed faults; data faults apply to every batch
            (x, y), = faults.transform([(x, y)])
        self.x, self.y = x, y
        self.small = [(x[:OVERFIT_SEQS, :OVERFIT_TOKENS], y[:OVERFIT_SEQS, :OVERFIT_TOKENS])]  # for structural steps

    def _loss(self, x, y, reduction="mean"):
        with self.state.precision.autocast():
            return self.model(x, y, reduction=reduction)

    def _step(self, batch, lr: float):
        st = self.state
        for group in st.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_ratio", 1.0)  # optim.name=muon: each group its own peak
        return train_step(self.model, batch, st.objective, st.optimizer, st.precision, st.scaler, self.lm.cfg.optim,
                          st.masters)

    # -- the checks -------------------------------------------------------------------------------------------

    @property
    def pretrained(self) -> str:
        """model.init of a fine-tune (a Hugging Face checkpoint's weights), "" for a model kiln initialised."""
        return self.lm.cfg.model.init

    @torch.no_grad()
    def init_loss(self) -> tuple[str, str, str]:
        loss = self._loss(self.x, self.y).item()
        V = self.model.cfg.padded_vocab
        expected = math.log(V)
        if self.pretrained:  # a trained base (fresh LoRA adapters add 0): it should beat the data's unigram model
            unigram = self.lm.data.unigram_loss
            status = FAIL if not math.isfinite(loss) or loss >= expected else PASS if loss <= unigram else WARN
            return (status, f"{loss:.3f} from {self.pretrained} vs the data's unigram loss {unigram:.3f} and ln({V}) "
                            f"= {expected:.3f}",
                    "a pretrained base should predict this data better than its unigram statistics: check that "
                    "data.tokenizer is the base's own (model.init implies it) and that the weights loaded")
        rel = (loss - expected) / expected
        status = FAIL if not math.isfinite(loss) else _grade(abs(rel), (0, 0.1), (0, 0.3))
        return (status, f"{loss:.3f} vs ln({V}) = {expected:.3f} ({rel:+.1%})",
                "initial logits should be near zero: init embeddings and head with a small std (0.02), and check "
                "the targets (a loss far below ln(vocab) at init often means they leak the inputs)")

    def overfit_one_batch(self) -> tuple[str, str, str]:
        batch, lr = self.small, self.lm.cfg.optim.lr
        first = last = None
        for step in range(1, OVERFIT_STEPS + 1):
            last = self._step(batch, lr).loss.item()
            first = last if first is None else first
            if not math.isfinite(last) or last < 0.1 * first:
                break
        ratio = last / first if math.isfinite(last) and first else float("inf")
        status = _grade(ratio, (0, 0.1), (0, 0.5))
        shape = "×".join(map(str, batch[0][0].shape))
        return (status, f"loss {first:.3f} → {last:.3f} in {step} steps on {shape} tokens (lr {lr:g})",
                "the model cannot memorize one batch: check the loss and targets, try --optim.lr=1e-3, and see "
                "gradient_flow for parameters that never learn")

    def gradient_flow(self) -> tuple[str, str, str]:
        self.model.zero_grad(set_to_none=True)
        self.state.scaler.scale_loss(self._loss(self.x, self.y)).backward()
        dead, frozen, waiting, total = [], [], [], 0
        sq = torch.zeros((), device=self.device, dtype=torch.float64)
        params = dict(self.model.named_parameters())
        for name, p in params.items():
            if not p.requires_grad:
                frozen.append(name)
                continue
            total += 1
            g = p.grad
            if g is None or not bool(torch.isfinite(g).all()) or not bool(g.any()):
                # a fresh LoRA adapter: A's gradient is Bᵀ·(...) = 0 while its B is 0 (B learns first)
                b = params.get(name.replace(".lora_A.", ".lora_B."))
                zero_b = ".lora_A." in name and b is not None and not bool(b.any())
                (waiting if zero_b and g is not None and bool(torch.isfinite(g).all()) else dead).append(name)
            if g is not None:
                sq += g.double().pow(2).sum()
        self.grad_norm_at_init = (sq.sqrt() / self.state.scaler.scale.double()).item()
        self.model.zero_grad(set_to_none=True)
        if dead:
            value = f"{len(dead)} of {total} trainable tensors get no finite non-zero gradient: {', '.join(dead[:6])}"
            value += " ..." if len(dead) > 6 else ""
            status = FAIL
        else:
            value, status = f"all {total} trainable tensors get a gradient", PASS
        if waiting:
            value += f" ({len(waiting)} LoRA A matrices at 0 while their B is 0, as expected at the start)"
        lora = self.lm.cfg.lora.on
        if frozen and lora:
            value += f"; the base's {len(frozen)} tensors are frozen (lora.rank={self.lm.cfg.lora.rank})"
        elif frozen:
            value += f"; {len(frozen)} frozen (requires_grad=False): {', '.join(frozen[:4])}"
            status = WARN if status == PASS else status
        return (status, value, "a parameter without gradient is cut off from the loss: look for .detach(), "
                               "torch.no_grad() or an unused module on its path")

    def targets_shifted(self) -> tuple[str, str, str]:
        x, y = self.x, self.y
        valid = y[:, :-1] != IGNORE_INDEX
        shifted = (y[:, :-1] == x[:, 1:]) | ~valid
        wrong = 1.0 - shifted.float().mean().item()
        same = ((y == x) | (y == IGNORE_INDEX)).float().mean().item()
        vocab = self.lm.data.tokenizer.vocab_size
        top = max(int(x.max()), int(y[y != IGNORE_INDEX].max()) if (y != IGNORE_INDEX).any() else 0,
                  int(np.max(self.lm.data.train)), int(np.max(self.lm.data.val)))
        problems = []
        if wrong > 0:
            problems.append(f"{wrong:.0%} of targets are not the next input" + (" (targets == inputs)" if same == 1
                                                                                 else ""))
        if top >= vocab or vocab > self.model.cfg.padded_vocab:
            problems.append(f"largest token id {top} vs tokenizer vocab {vocab}, model vocab "
                            f"{self.model.cfg.padded_vocab}")
        if problems:
            return (FAIL, "; ".join(problems),
                    "targets must be the inputs shifted left by one (y[:, t] = x[:, t+1]) and ids < vocab: check "
                    "the batch builder and the tokenizer's vocab_size")
        return (PASS, f"y[:, t] = x[:, t+1] on the batch; ids ≤ {top} < vocab {vocab} over both splits",
                "targets must be the inputs shifted left by one (y[:, t] = x[:, t+1]) and ids < vocab")

    @torch.no_grad()
    def data_finite(self) -> tuple[str, str, str]:
        fix = "remove NaN/Inf at the source: check the data pipeline and the embedding weights"
        if self.x.is_floating_point() and not bool(torch.isfinite(self.x).all()):
            return FAIL, "the input batch holds NaN/Inf", fix
        seen = {}

        def look(module, args):  # returns None: a pre-hook's return value would replace the block's arguments
            seen.setdefault("x", args[0])

        handle = self.model.blocks[0].register_forward_pre_hook(look)
        try:
            self._loss(self.x, self.y)
        finally:
            handle.remove()
        bad = int((~torch.isfinite(seen["x"])).sum())
        if bad:
            return FAIL, f"{bad} non-finite values in the embedded inputs", fix
        kind = "integer token ids (NaN/Inf cannot occur)" if not self.x.is_floating_point() else "finite inputs"
        return PASS, f"{kind}; embedded inputs finite (absmax {seen['x'].abs().max().item():.3g})", fix

    def train_eval_mode(self) -> tuple[str, str, str]:
        modes = []
        handle = self.model.register_forward_pre_hook(lambda m, args: modes.append(m.training))
        try:
            self.model.train()
            self._step(self.small, lr=0.0)
            in_train = list(modes)
            modes.clear()
            c = self.lm.cfg
            evaluate(self.model, val_batches(self.lm.data.val, OVERFIT_SEQS, c.data.seq_len, 1),
                     self.state.objective, self.state.precision, self.device)
            in_eval, after = list(modes), self.model.training
        finally:
            handle.remove()
        ok = all(in_train) and not any(in_eval) and after
        value = (f"train step in {'train' if all(in_train) else 'EVAL'} mode, evaluation in "
                 f"{'eval' if not any(in_eval) else 'TRAIN'} mode, {'train' if after else 'EVAL'} mode afterwards")
        return (PASS if ok else FAIL, value,
                "call model.train() before training steps and model.eval() (then back) around evaluation")

    def grads_cleared(self) -> tuple[str, str, str]:
        self._step(self.small, lr=0.0)
        if self.faults is not None:
            self.faults.begin_step(0)  # what the loop does before the next step
        params = [p for p in self.model.parameters() if p.requires_grad]
        stale = [p for p in params if p.grad is not None and bool(p.grad.any())]
        if self.state.masters is not None:
            stale += [m for m in self.state.masters.masters if m.grad is not None and bool(m.grad.any())]
        self.model.zero_grad(set_to_none=True)
        fix = ("call optimizer.zero_grad(set_to_none=True) after every optimizer step, or gradients add up across "
               "steps (an effective lr that grows every step)")
        if stale:
            return FAIL, f"{len(stale)} of {len(params)} tensors still hold the last step's gradient when the next " \
                         f"step starts", fix
        return PASS, f"all {len(params)} gradients are None after a step", fix

    @torch.no_grad()
    def weight_std(self) -> tuple[str, str, str]:
        n_layer = self.model.cfg.n_layer
        worst, rows, loaded = None, [], 0
        # the model's own init scheme where it states one (kiln's Transformer), else GPT-2's
        init_std = getattr(self.model, "init_std", None) or (
            lambda m: INIT_STD / math.sqrt(2 * n_layer) if getattr(m, "residual", False) else INIT_STD)
        for mod_name, module in self.model.named_modules():
            for p_name, p in module.named_parameters(recurse=False):
                name = f"{mod_name}.{p_name}" if mod_name else p_name
                kind = mod_name.rsplit(".", 1)[-1]
                if kind == "lora_A":  # PEFT's kaiming-uniform(a=√5): U(±1/√in), std 1/√(3·in)
                    expected = 1 / math.sqrt(3 * p.shape[1])
                    ratio = p.float().std().item() / expected
                    rows.append((name, abs(math.log(ratio)) if ratio > 0 else math.inf,
                                 f"std {ratio:.2f}× expected {expected:.4g}"))
                elif kind == "lora_B":  # B = 0: a fresh adapter leaves the base's output
                    off = p.float().abs().max().item()
                    rows.append((name, math.log1p(off / INIT_STD), f"max |B| = {off:.3g}"))
                elif self.pretrained:  # the base's trained weights follow no init scheme: finite is what to ask
                    loaded += 1
                    if not bool(torch.isfinite(p).all()):
                        rows.append((name, math.inf, f"non-finite values loaded from {self.pretrained}"))
                elif p.ndim >= 2 and init_std(module) == 0:  # model.zero_init_proj: the projection starts at 0
                    off = p.float().abs().max().item()
                    rows.append((name, math.log1p(off / INIT_STD), f"max |w| = {off:.3g} (starts at 0)"))
                elif p.ndim >= 2:
                    expected = init_std(module)
                    ratio = p.float().std().item() / expected
                    rows.append((name, abs(math.log(ratio)) if ratio > 0 else math.inf, f"std {ratio:.2f}× "
                                 f"expected {expected:.4g}"))
                elif p_name == "weight":  # norm gains start at 1
                    off = (p.float() - 1).abs().max().item()
                    rows.append((name, math.log1p(off), f"max |w - 1| = {off:.3g}"))
                else:  # biases start at 0
                    off = p.float().abs().max().item()
                    rows.append((name, math.log1p(off / INIT_STD), f"max |b| = {off:.3g}"))
        base = f"{loaded} tensors of the pretrained base finite (no init scheme to match)" if loaded else ""
        if not rows:
            return PASS, base, "the base's weights come from model.init"
        worst = max(rows, key=lambda r: r[1])
        status = _grade(worst[1], (0, math.log(1.25)), (0, math.log(2)))
        return (status, (f"{base}; " if base else "") + f"{len(rows)} tensors; worst {worst[0]}: {worst[2]}",
                f"re-initialize: N(0, {INIT_STD}) for matrices, {INIT_STD}/sqrt(2·n_layer) for residual "
                f"projections, 1 for norm gains, 0 for biases")

    @torch.no_grad()
    def activations(self) -> tuple[str, str, str]:
        stream, pre, post, handles = [], [], [], []

        def record_act(module, args, out):
            pre.append(args[0].float())  # the pre-activation (the gate, for SwiGLU)
            post.append(out.float())

        for block in self.model.blocks:
            handles.append(block.register_forward_hook(lambda m, a, out: stream.append(out.float()) and None))
            act = getattr(getattr(block, "mlp", None), "act", None)
            if act is not None:
                handles.append(act.register_forward_hook(record_act))
        try:
            self._loss(self.x, self.y)
        finally:
            for h in handles:
                h.remove()
        fix = ("unhealthy activations: check the init scale (weight_std), pre-norm placement and the residual "
               "scaling of output projections")
        if not all(bool(torch.isfinite(t).all()) for t in stream + post):
            return FAIL, "non-finite activations on the first batch", fix
        stds = [t.std().item() for t in stream]
        growth = stds[-1] / stds[0] if stds[0] > 0 else math.inf
        dead = [(o.flatten(0, -2) <= 0).all(0).float().mean().item() for o in post]  # units never positive
        saturated = [(p < -4).float().mean().item() for p in pre]  # flat negative tail of GELU/SiLU
        dead_max = max(dead, default=0.0)
        sat_max = max(saturated, default=0.0)
        status = max((_grade(growth, (0, 4), (0, 16)), _grade(dead_max, (0, 0.1), (0, 0.5)),
                      _grade(sat_max, (0, 0.1), (0, 0.5))), key=[PASS, WARN, FAIL].index)
        return (status, f"residual std {stds[0]:.3g} → {stds[-1]:.3g} over {len(stds)} blocks (×{growth:.2f}); "
                        f"dead MLP units ≤ {dead_max:.1%}; saturated pre-activations ≤ {sat_max:.1%}", fix)

    def warmup(self) -> tuple[str, str, str]:
        c = self.lm.cfg
        if c.optim.name not in ("adam", "adamw"):
            return PASS, f"{c.optim.name}: warmup optional", "warmup is optional for SGD"
        horizon = 1 / (1 - c.optim.beta2)
        fix = (f"add warmup (--schedule.warmup_steps={max(50, round(2 * horizon))}): Adam's second-moment estimate "
               f"averages ~{horizon:.0f} steps and is noisy before that")
        if c.schedule.warmup_steps == 0:
            return WARN, f"{c.optim.name} without warmup", fix
        return PASS, f"{c.schedule.warmup_steps} warmup steps (Adam β2={c.optim.beta2} averages ~{horizon:.0f})", fix

    def grad_norm(self) -> tuple[str, str, str]:
        g = self.grad_norm_at_init  # measured by gradient_flow on the first batch
        status = FAIL if not math.isfinite(g) else _grade(g, (1e-2, 1e2), (1e-4, 1e4))
        clip = self.lm.cfg.optim.grad_clip
        return (status, f"{g:.3g} at init" + (f" (clipped to {clip:g} each step)" if clip and g > clip else ""),
                "a norm far outside 0.01-100 at init means exploding or vanishing signal: check weight_std and "
                "activations, and keep --optim.grad_clip=1.0")


    def utilisation(self) -> tuple[str, str, str]:
        """A few real steps (lr 0: the weights stay; the optimizer state is put back): the share of the time spent
        stepping rather than waiting for the next batch."""
        st = self.state
        saved = copy.deepcopy(st.optimizer.state_dict())
        data_s = step_s = 0.0
        for _ in range(BUSY_STEPS):
            t0 = time.perf_counter()
            batch = [st.loader.next()]
            t1 = time.perf_counter()
            self._step(batch, 0.0)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            data_s, step_s = data_s + t1 - t0, step_s + time.perf_counter() - t1
        st.optimizer.load_state_dict(saved)
        busy = step_s / (step_s + data_s)
        value = (f"busy {busy:.0%}: {1000 * step_s / BUSY_STEPS:.1f} ms stepping, {1000 * data_s / BUSY_STEPS:.1f} ms "
                 f"waiting for each batch")
        fix = (f"the step waits for data {data_s / (step_s + data_s):.0%} of the time: raise data.prefetch, put the "
               f"source on a faster disk, or pre-tokenize; `kiln profile` breaks the step down")
        return (PASS if busy >= BUSY_MIN else WARN), value, fix


def run_checks(cfg, log=print) -> list[Check]:
    """Build the configured run in a temporary directory and run the whole checklist on it."""
    with tempfile.TemporaryDirectory(prefix="kiln-doctor-") as tmp:
        lm = build_lm(cfg, tmp, log=log)
        model = lm.state.model
        faults = FaultInjector(cfg.faults, model, lm.data.tokenizer.vocab_size) if cfg.faults.any else None
        try:
            doctor = Doctor(lm, faults)
            initial = clone_state(model.state_dict())
            order = [n for n, _, _ in CHECKS if n != 2] + [2]  # overfitting changes the weights: last
            results = {}
            for number in order:
                name = CHECKS[number - 1][1]
                if number == 11 and not hasattr(doctor, "grad_norm_at_init"):
                    doctor.gradient_flow()
                try:
                    status, value, fix = getattr(doctor, name)()
                except Exception as e:  # a check that crashes is a failed check, not a crashed doctor
                    status, value, fix = FAIL, f"the check raised {type(e).__name__}: {e}", "see the error"
                results[number] = Check(number, name, status, value, fix)
            model.load_state_dict(initial)
        finally:
            if faults is not None:
                faults.close()
            lm.state.loader.close()
    return [results[n] for n, _, _ in CHECKS]
