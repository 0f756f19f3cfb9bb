"""Task evaluation scored as lm-evaluation-harness 0.4 scores it: multiple choice (acc, acc_norm and their
standard errors) and perplexity (word and byte perplexity, bits per byte), on kiln's Transformer on any layout
(one process, data-, tensor-, context- or pipeline-parallel).

    kiln.evaluate.tasks     task files (kiln JSONL, HellaSwag and ARC rows, text:FILE) -> items; TaskError
    kiln.evaluate.encoding  text -> ids as the harness's HFLM tokenizes (post-processor tokens, prefix token)
    kiln.evaluate.forward   each row's log-likelihood through the validation pass's forward on any layout (a
                            scoring head in the loss's place: dp, tp, cp, pp)
    kiln.evaluate.loglik    encode_pair, rolling_windows, loglikelihoods, rolling_loglikelihoods (batched, split
                            over data-parallel ranks): the one log-likelihood implementation
    kiln.evaluate.metrics   per-item scores and the harness's aggregations
    kiln.evaluate.score     prepare(task) + score_task(model, prepared) -> TaskResult; training_tasks (train.eval_tasks)

`kiln eval` (kiln.cli.eval) and training's train.eval_tasks both score through score_task.
"""
from kiln.evaluate.loglik import Pair, encode_pair, loglikelihoods, rolling_loglikelihoods, rolling_windows
from kiln.evaluate.score import Prepared, TaskResult, prepare, score_task, training_tasks
from kiln.evaluate.tasks import Choice, Document, Task, TaskError, load_task, load_tasks

__all__ = ["Choice", "Document", "Pair", "Prepared", "Task", "TaskError", "TaskResult", "encode_pair", "load_task",
           "load_tasks", "loglikelihoods", "prepare", "rolling_loglikelihoods", "rolling_windows", "score_task"]
