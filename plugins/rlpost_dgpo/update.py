"""The DGPO update rule (``dgpo``): Direct Group Preference Optimization on re-noised clean samples.

Luo, Hu, Tang, "Reinforcing Diffusion Models by Direct Group Preference Optimization" (arXiv 2510.08425, ICLR 2026);
code Luo-Yihong/DGPO @01ceb4b (``scripts/train_sd3_dgpo.py``). The rollout is a deterministic ODE (the built-in
``solver`` sampler); this rule never looks at its edges. Per training step (upstream L1046-1215):

1. ``M = num_train_timesteps`` step indices are drawn without replacement from ``0 … trunc_steps`` of the rollout's
   grid, one set for the whole step (every rank, every minibatch; upstream L52-73 draws it on rank 0 and broadcasts
   it). rlpost draws it from a generator keyed by ``(run seed, step)`` alone, so any rank count and a resume draw
   the same set.
2. Each clean sample ``x0`` is re-noised at each drawn ``σ``: ``x_σ = (1−σ)·x0 + σ·ε``, target ``ε − x0``. With
   ``use_shared_noise`` every member of a prompt group shares one ``ε`` per timestep (upstream L76-107), keyed by
   the global group.
3. The live policy predicts ``v_θ`` at ``train_guidance`` (1.0: the conditional branch alone, upstream's
   ``predict_v(..., cfg=False)``, L290-330); the frozen reference (LoRA off) predicts ``v_ref`` at ``kl_cfg``
   (CFG when above 1, upstream L1110-1115); the ``ema_ref`` copy predicts ``v_old`` at ``train_guidance`` when the
   clip or ``use_ema_ref`` needs it (L1116-1119).
4. The loss of :mod:`rlpost_dgpo.loss` per sample and timestep, plus ``kl_beta·mean_elem((v_θ − v_ref)²)``,
   averaged over the step's ``S·M`` rows; gradients accumulate over minibatches of whole groups and the backend
   takes one optimizer step.

Groups: the group score ``S_g`` sums over every member of a group. Upstream's members may sit on several GPUs, so it
all-reduces the per-group sums (L181-186). rlpost's ranks hold whole groups (``rlpost/engine/sharding.py``) and a
minibatch here holds whole groups, so the sum is local and no collective is needed.

The ``ema_ref`` copy (recipe ``copies: {ema_ref: {rate: 0.001, cap: 0.3}}``, upstream L1175-1177) is also what the
rollout runs under after step ``switch_ema_ref`` (:meth:`DGPOUpdate.rollout_copy`, upstream L799-800 and L878-879).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar

import torch
from torch import Tensor

from rlpost import (
    CLEAN_SAMPLES,
    REFERENCE,
    CleanBatch,
    PolicyOptimizer,
    Range,
    StepCounts,
    TrainCounts,
    UpdateContext,
    UpdateResult,
    clean_batch,
    keyed_generator,
    noise_for,
    renoise,
    subset_without_replacement,
)

from .loss import denoising_error, dgpo_terms

__all__ = ["EMA_REF", "DGPOUpdate", "group_chunks"]

EMA_REF = "ema_ref"
"""The weight copy DGPO clips against, rolls out under after ``switch_ema_ref`` and (``use_ema_ref``) compares with."""

_FIELD = "optimizer.init_args."


def group_chunks(groups: Tensor, size: int) -> list[Tensor]:
    """Sample positions ``0 … S−1`` cut into consecutive minibatches of whole groups, each of at most ``size`` samples
    (``0``: one minibatch). Members of a group must be adjacent (rollout order).

    Raises:
        ValueError: A group has more than ``size`` samples, or its members are not adjacent.
    """
    total = int(groups.numel())
    starts = [0] + [i for i in range(1, total) if int(groups[i]) != int(groups[i - 1])]
    spans = list(zip(starts, [*starts[1:], total], strict=True))
    if len({int(groups[a]) for a, _ in spans}) != len(spans):
        raise ValueError("dgpo: the members of a prompt group are not adjacent in the rollout")
    chunks: list[Tensor] = []
    lo = hi = 0
    for a, b in spans:
        if size > 0 and b - a > size:
            raise ValueError(
                f"{_FIELD}minibatch_samples: {size} is smaller than a prompt group ({b - a} samples); a minibatch "
                "holds whole groups (the group score sums over every member)"
            )
        if size > 0 and b - lo > size and hi > lo:
            chunks.append(torch.arange(lo, hi))
            lo = a
        hi = b
    if hi > lo:
        chunks.append(torch.arange(lo, hi))
    return chunks


class DGPOUpdate(PolicyOptimizer):
    """DGPO's group-preference loss on re-noised clean samples (module docstring), with the PPO-style clip against
    the ``ema_ref`` copy and a KL term to the frozen reference.

    Args:
        beta_dpo: ``β_dpo`` scaling the group score ``S_g`` (upstream ``config.train.beta_dpo``).
        kl_beta: Weight of ``mean_elem((v_θ − v_ref)²)``; 0 drops the term (``config.train.beta``).
        kl_cfg: Guidance of the frozen reference's velocity: ``1.0`` its conditional branch alone, ``g > 1`` CFG at
            ``g`` (needs a model configured with CFG, so the negative prompt is encoded), ``null`` the model's
            configured guidance (FLUX.1: its distilled guidance embedding). Upstream ``config.kl_cfg``.
        clip_range: The PPO-style clip's ``c`` (``config.clip_range``).
        clip_dsm: Clip: samples whose ratio ``exp(−d_i + d_i^old)`` leaves the band on their advantage's side train
            without gradient (``config.clip_dsm``).
        num_train_timesteps: ``M``, timesteps trained per step (``config.num_train_timesteps``).
        trunc_steps: The timesteps are drawn from grid indices ``0 … trunc_steps`` (``config.trunc_steps``; must be
            below the sampler's ``num_steps``).
        use_shared_noise: One re-noising ``ε`` per prompt group and timestep (``config.use_shared_noise``); false:
            one per sample.
        use_ema_ref: Compare with the ``ema_ref`` copy in ``S_g`` instead of the frozen reference (``config.
            use_ema_ref``, the "dynamic reference" of TDM-R1, arXiv 2603.07700).
        switch_ema_ref: Rollouts of steps after this one run under the ``ema_ref`` copy (``config.switch_ema_ref``).
        adv_clip_max: Advantages are clamped to ``±adv_clip_max`` (``config.train.adv_clip_max``).
        minibatch_samples: Most samples per forward/backward minibatch (memory only), rounded down to whole groups;
            0: all of a step's samples at once.
        train_guidance: Guidance of the live policy's (and the ``ema_ref`` copy's) velocity: ``1.0`` the
            conditional branch alone (upstream trains without CFG), ``null`` the model's configured guidance.
    """

    name: ClassVar[str] = "dgpo"
    requires: ClassVar[frozenset[str]] = frozenset({CLEAN_SAMPLES})

    def __init__(
        self,
        beta_dpo: Annotated[float, Range(gt=0)] = 100.0,
        kl_beta: Annotated[float, Range(ge=0)] = 0.02,
        kl_cfg: Annotated[float, Range(ge=1)] | None = 1.0,
        clip_range: Annotated[float, Range(gt=0)] = 1e-2,
        clip_dsm: bool = True,
        num_train_timesteps: Annotated[int, Range(ge=1)] = 4,
        trunc_steps: Annotated[int, Range(ge=0)] = 4,
        use_shared_noise: bool = True,
        use_ema_ref: bool = False,
        switch_ema_ref: Annotated[int, Range(ge=0)] = 200,
        adv_clip_max: Annotated[float, Range(gt=0)] = 5.0,
        minibatch_samples: Annotated[int, Range(ge=0)] = 0,
        train_guidance: Annotated[float, Range(ge=1)] | None = 1.0,
    ) -> None:
        self.beta_dpo = beta_dpo
        self.kl_beta = kl_beta
        self.kl_cfg = kl_cfg
        self.clip_range = clip_range
        self.clip_dsm = clip_dsm
        self.num_train_timesteps = num_train_timesteps
        self.trunc_steps = trunc_steps
        self.use_shared_noise = use_shared_noise
        self.use_ema_ref = use_ema_ref
        self.switch_ema_ref = switch_ema_ref
        self.adv_clip_max = adv_clip_max
        self.minibatch_samples = minibatch_samples
        self.train_guidance = train_guidance

    # ------------------------------------------------------------------------------------ what it evaluates

    @property
    def uses_reference(self) -> bool:
        """The frozen reference runs when the KL term or the group score (without ``use_ema_ref``) needs it."""
        return self.kl_beta > 0 or not self.use_ema_ref

    @property
    def uses_ema_ref(self) -> bool:
        """The ``ema_ref`` copy runs for the clip and for the group score with ``use_ema_ref``."""
        return self.clip_dsm or self.use_ema_ref

    def required_copies(self) -> frozenset[str]:
        """``ema_ref``: clipped against, compared with (``use_ema_ref``) and rolled out under after the switch."""
        return frozenset({EMA_REF})

    def rollout_copy(self, step: int) -> str | None:
        """``ema_ref`` for steps after ``switch_ema_ref`` (upstream: ``global_step > switch_ema_ref``), else live."""
        return EMA_REF if step > self.switch_ema_ref else None

    def train_counts(self, counts: StepCounts) -> TrainCounts:
        """``S·M`` rows with gradients; ``S·M`` no-grad rows of the reference and of ``ema_ref`` when they run (a CFG
        reference call is counted by its rows before CFG doubling, as ``Policy.forward_count`` counts)."""
        rows = counts.images * self.num_train_timesteps
        nograd: dict[str, int] = {}
        if self.uses_reference:
            nograd[REFERENCE] = rows
        if self.uses_ema_ref:
            nograd[EMA_REF] = rows
        per_call = min(counts.images, self.minibatch_samples) if self.minibatch_samples else counts.images
        return TrainCounts(grad_rows=rows, nograd_rows={k: v for k, v in nograd.items() if v}, rows_per_call=per_call)

    def timestep_indices(self, seed: int, step: int) -> Tensor:
        """``[M]`` long: the grid indices step ``step`` trains, a function of ``(seed, step)`` alone."""
        return subset_without_replacement(keyed_generator(seed, step), self.trunc_steps, self.num_train_timesteps)

    # ------------------------------------------------------------------------------------------- validation

    def validate(self, recipe: Any) -> list[str]:
        """Timesteps within the sampler's grid, minibatches of whole groups, and CFG available where a guidance above
        1 asks for it."""
        problems = []
        if self.num_train_timesteps > self.trunc_steps + 1:
            problems.append(
                f"{_FIELD}num_train_timesteps: {self.num_train_timesteps} distinct timesteps cannot be drawn from the "
                f"{self.trunc_steps + 1} grid indices 0 … trunc_steps ({self.trunc_steps})"
            )
        steps = getattr(recipe.sampler, "num_steps", None)
        if isinstance(steps, int) and not isinstance(steps, bool) and self.trunc_steps > steps - 1:
            problems.append(
                f"{_FIELD}trunc_steps: {self.trunc_steps} is past the sampler's last step (num_steps {steps}: grid "
                f"indices 0 … {steps - 1} have a noise level above 0)"
            )
        images, groups = recipe.counts().images, recipe.run.groups_per_step
        group_size = images // groups if groups else 0
        if 0 < self.minibatch_samples < group_size:
            problems.append(
                f"{_FIELD}minibatch_samples: {self.minibatch_samples} is smaller than a prompt group ({group_size} "
                "samples); a minibatch holds whole groups (the group score sums over every member); use 0 or >= "
                f"{group_size}"
            )
        if getattr(recipe.model, "do_cfg", None) is False:  # a CFG adapter configured without CFG
            asks = [("kl_cfg", self.kl_cfg, self.uses_reference), ("train_guidance", self.train_guidance, True)]
            for field, value, used in asks:
                if used and value is not None and value > 1:
                    problems.append(
                        f"{_FIELD}{field}: {value:g} needs classifier-free guidance, but the model is configured "
                        "without it (no negative prompt is encoded); set the model's guidance scale above 1 "
                        f"(model.init_args.guidance_scale; Qwen-Image: true_cfg_scale) or {field}: 1.0"
                    )
        return problems

    # ------------------------------------------------------------------------------------------------ update

    def update(self, ctx: UpdateContext) -> UpdateResult:
        """One optimizer step of DGPO over the rollout's clean samples (module docstring)."""
        batch = clean_batch(ctx)
        if batch.size == 0:
            return UpdateResult(trained_edges=0, train_forwards=0, reference_forwards=0, nonfinite_losses=0)
        sigmas = ctx.rollout.sigmas.to(torch.float32)
        if self.trunc_steps > sigmas.numel() - 2:
            raise ValueError(
                f"{_FIELD}trunc_steps: {self.trunc_steps} is past the rollout's last step ({sigmas.numel() - 1} steps)"
            )
        indices = self.timestep_indices(ctx.seed, ctx.step)
        adv = batch.advantages.clamp(-self.adv_clip_max, self.adv_clip_max)
        stats: dict[str, list[float]] = {}
        rows = {"grad": 0, REFERENCE: 0, EMA_REF: 0}
        nonfinite = 0
        scale = 1.0 / (batch.size * len(indices))  # the step's loss is the mean over its S·M rows
        ctx.policy.train(True)
        try:
            for chunk in group_chunks(batch.groups, self.minibatch_samples):
                for m, index in enumerate(indices.tolist()):
                    loss, out = self._loss(ctx, batch, chunk, m, sigmas[index], adv[chunk.to(adv.device)], rows)
                    for key, value in out.items():
                        stats.setdefault(key, []).append(value)
                    loss = loss * scale
                    if not torch.isfinite(loss):
                        nonfinite += 1  # never reaches backward; the run's loss guard acts on the count
                        continue
                    ctx.backend.backward(loss)
        finally:
            ctx.policy.train(False)
        step = ctx.backend.step()
        metrics = self._metrics(stats, sigmas[indices])
        metrics.update(step)
        copies = {name: n for name, n in rows.items() if name != "grad" and n}
        return UpdateResult(
            trained_edges=0,  # a likelihood-free rule trains no edges
            train_forwards=rows["grad"],
            reference_forwards=sum(copies.values()),
            nonfinite_losses=nonfinite,
            metrics=metrics,
            copy_forwards=copies,
        )

    def _noise(self, ctx: UpdateContext, batch: CleanBatch, chunk: Tensor, m: int) -> Tensor:
        """``ε`` of each sample of ``chunk`` at the ``m``-th drawn timestep: one per global group (shared noise) or
        per sample, keyed so that neither the rank count nor the minibatch layout changes it."""
        shape = tuple(batch.x0.shape[1:])
        if self.use_shared_noise:
            per_group: dict[int, Tensor] = {}
            for g in batch.groups[chunk].tolist():
                if g not in per_group:
                    per_group[g] = noise_for(ctx.seed, ctx.step, (g,), shape, m)
            eps = [per_group[g] for g in batch.groups[chunk].tolist()]
        else:
            eps = [noise_for(ctx.seed, ctx.step, batch.keys[i], shape, m) for i in chunk.tolist()]
        return torch.stack(eps).to(batch.x0.device)

    def _loss(
        self,
        ctx: UpdateContext,
        batch: CleanBatch,
        chunk: Tensor,
        m: int,
        level: Tensor,
        adv: Tensor,
        rows: dict[str, int],
    ) -> tuple[Tensor, dict[str, float]]:
        """Summed DGPO + KL loss of ``chunk`` at one timestep (divide by ``S·M`` for the step's mean)."""
        policy = ctx.policy
        x0 = batch.x0[chunk.to(batch.x0.device)]
        cond = batch.cond.select(chunk)
        eps = self._noise(ctx, batch, chunk, m)
        sigma = level.to(x0.device).expand(x0.shape[0]).contiguous()
        x_t = renoise(x0, sigma, eps)
        target = eps - x0
        n = int(x0.shape[0])
        v_ref = v_old = None
        with torch.no_grad():
            if self.uses_reference:
                with ctx.weight_copies.use(REFERENCE):
                    v_ref = policy.velocity(x_t, sigma, cond, guidance=self.kl_cfg)
                rows[REFERENCE] += n
            if self.uses_ema_ref:
                with ctx.weight_copies.use(EMA_REF):
                    v_old = policy.velocity(x_t, sigma, cond, guidance=self.train_guidance)
                rows[EMA_REF] += n
        v = policy.velocity(x_t, sigma, cond, guidance=self.train_guidance)
        rows["grad"] += n
        d = denoising_error(target, v)
        d_old = denoising_error(target, v_old) if v_old is not None else None
        d_cmp = d_old if self.use_ema_ref else denoising_error(target, v_ref) if v_ref is not None else None
        assert d_cmp is not None  # uses_reference or uses_ema_ref provides it
        terms = dgpo_terms(
            d, d_cmp, adv, batch.groups[chunk], self.beta_dpo, d_old if self.clip_dsm else None, self.clip_range
        )
        loss = terms.loss.sum()
        out = {  # sums over the chunk's rows; the step's metrics divide by all rows
            "rows": float(n),
            "policy": float(terms.loss.detach().sum()),
            "dsm": float(d.detach().sum()),
            "weight": float(terms.weights.sum()),
            "clipped": float(terms.clipped.sum()),
        }
        if v_ref is not None:
            kl = denoising_error(v_ref, v)
            if self.kl_beta > 0:
                loss = loss + self.kl_beta * kl.sum()
            out["kl"] = float(kl.detach().sum())
        return loss, out

    def _metrics(self, stats: dict[str, list[float]], levels: Tensor) -> dict[str, float]:
        total = sum(stats.get("rows", []))

        def mean(key: str) -> float:
            values = stats.get(key, [])
            return float(sum(values) / total) if values and total else math.nan

        metrics = {
            "loss/policy": mean("policy"),
            "loss/dsm": mean("dsm"),
            "train/group_weight": mean("weight"),
            "train/sigma_mean": float(levels.mean()),
            "train/optimizer_steps": 1.0,
        }
        if "kl" in stats:
            metrics["loss/kl"] = mean("kl")
        if self.clip_dsm:
            metrics["train/clipfrac"] = mean("clipped")
        return metrics
