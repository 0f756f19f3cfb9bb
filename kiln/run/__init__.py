"""Training built from a Config: kiln's language-model job, fit() for any nn.Module, and what runs training to
look at it (the doctor's checklist, measured memory).

    kiln.run.lm       build_lm (the one builder from a Config), train (`kiln train`), generate_text
    kiln.run.fit      fit(model, data, loss=..., config=...): a user's own model through the same Trainer
    kiln.run.doctor   `kiln doctor`'s checks
    kiln.run.measure  `kiln memory --measure` / `kiln plan --verify`
    kiln.run.sample   `kiln sample`: prompt files, chat templates
    kiln.run.generate text generation (KV cache, stop strings), shared by `kiln sample` and the train-end sample
    kiln.run.source   RUN_DIR, RUN_DIR/checkpoints/step_N or hf:DIR loaded for `kiln eval` and `kiln sample`
"""
