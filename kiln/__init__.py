"""kiln: train transformer language models — or any PyTorch model — on one GPU or a plain CPU.

The library API (the `kiln` command is kiln.cli):

    fit(model, train_data, loss=..., config=..., eval_data=..., epochs=..., callbacks=[...], metrics={...},
        run_dir=..., resume=...)                                                        any nn.Module
    predict(model, data, batch_size=None, device=None)                                its outputs over data
    kiln.run.lm.train(cfg, run_dir, resume=...)                                          kiln's language models
    load_config(path, overrides), Config                                                 the configuration
    losses: CrossEntropy, MSE, Huber, BCEWithLogits, NTXent, as_loss
    objectives: Supervised, Contrastive, LanguageModeling
    parts: build_state (TrainState), Trainer, TrainResult, ModelPlan / prepare_model
"""
from kiln.config import Config, load_config
from kiln.errors import KilnError
from kiln.run.entry import fit
from kiln.run.fit_checks import FitInputError, FitWarning
from kiln.run.predict import predict
from kiln.train.loop import Trainer, TrainResult
from kiln.train.losses import MSE, BCEWithLogits, CrossEntropy, Huber, NTXent, as_loss
from kiln.train.objective import Contrastive, LanguageModeling, Supervised
from kiln.train.pipeline import ModelPlan, prepare_model
from kiln.train.state import TrainState, build_state

__version__ = "0.1.0"

# (kiln's own language-model run is kiln.run.lm.train: exported here it would hide the kiln.train package.)
__all__ = ["fit", "predict", "KilnError", "FitInputError", "FitWarning", "Config", "load_config", "CrossEntropy", "MSE", "Huber", "BCEWithLogits", "NTXent",
           "as_loss", "Supervised", "Contrastive", "LanguageModeling", "TrainState", "build_state", "Trainer",
           "TrainResult", "ModelPlan", "prepare_model"]
