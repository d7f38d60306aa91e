"""``jax_kl.tunix.FusedLogitStrategy`` against Tunix's own ``LogitStrategy`` on full logits."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip(
    "tunix.distillation", reason="jax_kl.tunix needs google-tunix: pip install 'fused-kl[tunix]' (Python >= 3.11)"
)

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from tunix.distillation import distillation_trainer
from tunix.distillation.strategies import LogitStrategy

from jax_kl.tunix import FusedLogitStrategy

V, B, T, TEMPERATURE, ALPHA = 64, 4, 8, 2.0, 0.3


class _TinyLM(nnx.Module):
    def __init__(self, hidden: int, seed: int) -> None:
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(V, hidden, rngs=rngs)
        self.norm = nnx.LayerNorm(hidden, rngs=rngs)
        self.lm_head = nnx.Linear(hidden, V, rngs=rngs)

    def hidden(self, tokens: jax.Array) -> jax.Array:
        return self.norm(self.embed(tokens))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.lm_head(self.hidden(tokens))


def _logits(model: _TinyLM, input_tokens: jax.Array, input_mask: jax.Array) -> jax.Array:
    return model(input_tokens)


def _hidden(model: _TinyLM, input_tokens: jax.Array, input_mask: jax.Array) -> jax.Array:
    return model.hidden(input_tokens)


def _one_hot(input_tokens: jax.Array, input_mask: jax.Array) -> jax.Array:
    return jax.nn.one_hot(input_tokens, V)


def _ids(input_tokens: jax.Array, input_mask: jax.Array) -> jax.Array:
    return jnp.where(input_mask, input_tokens, -100)


def _tunix() -> LogitStrategy:
    return LogitStrategy(_logits, _logits, _one_hot, temperature=TEMPERATURE, alpha=ALPHA)


def _fused() -> FusedLogitStrategy:
    return FusedLogitStrategy(_hidden, _hidden, _ids, temperature=TEMPERATURE, alpha=ALPHA)


def _batch(seed: int, mask: np.ndarray | None = None) -> distillation_trainer.TrainingInput:
    tokens = np.random.default_rng(seed).integers(0, V, (B, T))
    mask = np.ones((B, T), bool) if mask is None else mask
    return distillation_trainer.TrainingInput(input_tokens=jnp.asarray(tokens, jnp.int32), input_mask=jnp.asarray(mask))


def _params(model: nnx.Module) -> list[jax.Array]:
    return jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _train(strategy: LogitStrategy | FusedLogitStrategy, steps: int) -> nnx.Module:
    student, teacher = _TinyLM(16, 0), _TinyLM(32, 1)
    config = distillation_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=steps)
    trainer = distillation_trainer.DistillationTrainer(student, teacher, strategy, optax.sgd(0.5), config)
    trainer.train([_batch(seed) for seed in range(steps)])
    return student


def test_distillation_trainer_steps_match_tunix_logit_strategy() -> None:
    tunix_student, fused_student = _train(_tunix(), 3), _train(_fused(), 3)
    start = _params(_TinyLM(16, 0))
    for initial, expected, got in zip(start, _params(tunix_student), _params(fused_student), strict=True):
        assert float(jnp.abs(expected - initial).max()) > 1e-3  # the steps moved every parameter
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_loss_leaves_out_ignored_positions_where_tunix_averages_every_position() -> None:
    student, teacher = _TinyLM(16, 0), _TinyLM(32, 1)
    mask = np.ones((B, T), bool)
    mask[::2, -3:] = False
    batch = _batch(7, mask)
    inputs = {"input_tokens": batch.input_tokens, "input_mask": batch.input_mask}
    strategy = _fused()
    loss, _ = strategy.get_train_loss(student, strategy.get_teacher_outputs(teacher, inputs), inputs)
    keep = jnp.asarray(mask)
    expected, _ = _tunix().compute_loss(
        student(batch.input_tokens)[keep], teacher(batch.input_tokens)[keep], _one_hot(batch.input_tokens[keep], None)
    )
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    everywhere, _ = _tunix().compute_loss(student(batch.input_tokens), teacher(batch.input_tokens),
                                          _one_hot(batch.input_tokens, None))  # fmt: skip
    assert abs(float(everywhere) - float(loss)) > 1e-4


def test_eval_loss_matches_tunix_task_loss() -> None:
    student = _TinyLM(16, 0)
    batch = _batch(3)
    inputs = {"input_tokens": batch.input_tokens, "input_mask": batch.input_mask}
    loss, _ = _fused().get_eval_loss(student, inputs)
    expected, _ = _tunix().get_eval_loss(student, inputs)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_teacher_output_is_hidden_states_and_head_never_logits() -> None:
    batch = _batch(0)
    inputs = {"input_tokens": batch.input_tokens, "input_mask": batch.input_mask}
    output = _fused().get_teacher_outputs(_TinyLM(32, 1), inputs)
    assert output.hidden.shape == (B, T, 32)
    assert output.head.weight.shape == (V, 32) and output.head.bias.shape == (V,)


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan")])
def test_alpha_outside_the_unit_interval_is_a_value_error(alpha: float) -> None:
    with pytest.raises(ValueError, match=r"^alpha: expected a number in \[0, 1\]"):
        FusedLogitStrategy(_hidden, _hidden, _ids, alpha=alpha)


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        ({"alpha": "0.5"}, TypeError, r"^alpha: expected a number in \[0, 1\], got str"),
        ({"temperature": 0.0}, ValueError, r"^temperature: expected a finite number > 0"),
        ({"temperature": "2"}, TypeError, r"^temperature: expected a finite number > 0, got str"),
    ],
)
def test_bad_alpha_or_temperature_is_refused_at_construction(keywords: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        FusedLogitStrategy(_hidden, _hidden, _ids, **keywords)
