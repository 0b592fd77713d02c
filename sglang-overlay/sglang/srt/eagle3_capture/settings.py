"""Environment settings of the hidden-state dump and the checks that guard them."""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import List, Optional, Sequence

from .release import SERIES_RELEASE, SERIES_VERSION, UPSTREAM_EAGLE_ID_MAPPING

__all__ = ["SERIES_RELEASE", "SERIES_VERSION"]  # re-exported for the package

ENV_DIR = "EAGLE3_DUMP_DIR"
ENV_LAYERS = "EAGLE3_DUMP_LAYERS"
ENV_FINAL = "EAGLE3_DUMP_FINAL"
ENV_MAX_PENDING_MB = "EAGLE3_DUMP_MAX_PENDING_MB"
DEFAULT_MAX_PENDING_MB = 2048


class DumpConfigError(ValueError):
    """A setting under which the dump would be wrong; the message names the fix."""


def capture_index(layer_id: int) -> int:
    """EAGLE-3 id k (output of layer k, -1 = embedding) -> input index of layer k + 1."""
    return layer_id + 1


def upstream_capture_indices(layer_ids: Sequence[int]) -> List[int]:
    """What unpatched sglang SERIES_RELEASE would capture for these draft-config ids."""
    if UPSTREAM_EAGLE_ID_MAPPING == "plus_one" or (layer_ids and layer_ids[0] == 1):
        return [k + 1 for k in layer_ids]
    return list(layer_ids)


def hf_index(layer_id: int) -> int:
    """EAGLE-3 id k -> index into Hugging Face ``output_hidden_states`` (the capture index)."""
    return capture_index(layer_id)


def default_layer_ids(num_layers: int) -> List[int]:
    """The EAGLE-3 ids SGLang captures when a draft names none."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def check_layer_ids(ids: Sequence[int], num_layers: int, what: str) -> None:
    bad = [k for k in ids if not -1 <= k <= num_layers - 1]
    if bad:
        raise DumpConfigError(
            f"{what} {list(ids)}: ids {bad} are out of range for a {num_layers}-layer model; "
            f"use -1 (embedding output) .. {num_layers - 1} (the last layer's output before the "
            f"final norm)"
        )


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise DumpConfigError(f"{name}={raw!r} is not a boolean; use 1 or 0")


@dataclasses.dataclass(frozen=True)
class DumpSettings:
    directory: str
    layer_ids: Optional[List[int]]  # None: the model's EAGLE-3 default
    final: bool
    max_pending_bytes: int

    @classmethod
    def from_env(cls, env=None) -> Optional["DumpSettings"]:
        env = os.environ if env is None else env
        directory = env.get(ENV_DIR, "").strip()
        if not directory:
            return None
        layer_ids = None
        raw_layers = env.get(ENV_LAYERS, "").strip()
        if raw_layers:
            try:
                layer_ids = [int(part) for part in raw_layers.split(",") if part.strip()]
            except ValueError:
                raise DumpConfigError(
                    f"{ENV_LAYERS}={raw_layers!r} is not a comma-separated list of "
                    f"integers; use e.g. {ENV_LAYERS}=-1,2,30"
                ) from None
            if len(set(layer_ids)) != len(layer_ids) or not layer_ids:
                raise DumpConfigError(
                    f"{ENV_LAYERS}={raw_layers!r} must name each layer once; "
                    f"use e.g. {ENV_LAYERS}=-1,2,30"
                )
        final = _parse_bool(ENV_FINAL, env.get(ENV_FINAL, "1"))
        raw_cap = env.get(ENV_MAX_PENDING_MB, str(DEFAULT_MAX_PENDING_MB)).strip()
        try:
            cap_mb = float(raw_cap)
        except ValueError:
            cap_mb = -1.0
        if cap_mb <= 0:
            raise DumpConfigError(
                f"{ENV_MAX_PENDING_MB}={raw_cap!r} must be a positive number of MiB; "
                f"use e.g. {ENV_MAX_PENDING_MB}={DEFAULT_MAX_PENDING_MB}"
            )
        return cls(directory, layer_ids, final, int(cap_mb * (1 << 20)))

    def resolved_layer_ids(self, num_layers: int) -> List[int]:
        ids = self.layer_ids
        if ids is None:
            ids = default_layer_ids(num_layers)
        check_layer_ids(ids, num_layers, ENV_LAYERS)
        return sorted(set(ids))  # small models repeat default ids


def check_directory(directory: str) -> None:
    """The dump directory must exist and take a file; nothing is left behind."""
    if not os.path.isdir(directory):
        raise DumpConfigError(
            f"{ENV_DIR}={directory!r} is not an existing directory; create it "
            f"(mkdir -p {directory}) or point {ENV_DIR} elsewhere"
        )
    probe = os.path.join(directory, f".eagle3-probe-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        with open(probe, "wb") as handle:
            handle.write(b"probe")
    except OSError as exc:
        raise DumpConfigError(
            f"{ENV_DIR}={directory!r} is not writable ({exc.strerror}); make it "
            f"writable for the server's user or point {ENV_DIR} elsewhere"
        ) from None
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass


def resolved(args):
    """The values the release decided: releases that resolve server arguments keep the raw
    input apart (0.5.23: ``chunked_prefill_size`` is None raw, 4096 resolved), others write
    the results back into the fields."""
    for module in ("sglang.srt.arg_groups.model_override_base", "sglang.srt.arg_groups.overrides"):
        try:
            view = __import__(module, fromlist=["resolving_view"]).resolving_view
        except (ImportError, AttributeError):
            continue
        return view(args)
    return args


def _prefill_graph(args) -> Optional[str]:
    """The prefill CUDA-graph backend in force, or None when prefill runs eagerly."""
    if getattr(args, "disable_cuda_graph", False) or getattr(args, "disable_prefill_cuda_graph", False):
        return None
    backend = None
    config = getattr(args, "cuda_graph_config", None)
    if config is not None:
        phase = config.get("prefill") if isinstance(config, dict) else getattr(config, "prefill", None)
        backend = phase.get("backend") if isinstance(phase, dict) else getattr(phase, "backend", None)
    backend = backend or getattr(args, "cuda_graph_backend_prefill", None)
    backend = getattr(backend, "value", backend)
    if backend in (None, "disabled"):
        return None
    return str(backend)


def check_server_args(args) -> None:
    """Refuse server settings under which dumped rows would be incomplete or wrong. Argument
    names differ between releases: each rule reads the names its release has."""
    args = resolved(args)

    def arg(name, default=None):
        value = getattr(args, name, default)
        return default if value is None else value

    tp_size = arg("tp_size", 1)
    attn_dp = max(arg("attn_dp_size", 1), 2 if arg("enable_dp_attention", False) else 1)
    attn_cp = arg("attn_cp_size", 1)
    a2a = arg("moe_a2a_backend", "none")
    a2a = str(getattr(a2a, "value", a2a) or "none")
    graph = _prefill_graph(args)
    rules = [
        (
            not arg("disable_radix_cache", False),
            "the radix cache is on (prefix-cache hits skip rows); add --disable-radix-cache",
        ),
        (
            arg("enable_mixed_chunk", False),
            "--enable-mixed-chunk puts decode tokens into prefill batches; drop it",
        ),
        (
            arg("enable_two_batch_overlap", False),
            "--enable-two-batch-overlap runs layers outside the capture loop; drop it",
        ),
        (
            arg("enable_piecewise_cuda_graph", False),
            "--enable-piecewise-cuda-graph would bake the dump into a graph; drop it",
        ),
        (
            graph is not None,
            f"a prefill CUDA graph (--cuda-graph-backend-prefill {graph}) would bake the dump into "
            f"a graph; add --disable-prefill-cuda-graph",
        ),
        (
            attn_dp > 1,
            "DP attention (--attn-dp-size / --enable-dp-attention) splits requests across "
            "attention ranks; drop it",
        ),
        (
            arg("pp_size", 1) > 1,
            f"--pp-size {arg('pp_size', 1)} puts capture layers on other pipeline stages; use --pp-size 1",
        ),
        (
            a2a != "none",
            f"--moe-a2a-backend {a2a} scatters hidden states across ranks; use --moe-a2a-backend none",
        ),
        (
            arg("enable_attn_tp_input_scattered", False) and tp_size > 1,
            "--enable-attn-tp-input-scattered splits prefill tokens across ranks; drop it",
        ),
        (
            arg("enable_pdmux", False),
            "--enable-pdmux splits prefills across forwards; drop it",
        ),
        (
            arg("enable_nsa_prefill_context_parallel", False),
            "--enable-nsa-prefill-context-parallel splits prefill tokens across ranks; drop it",
        ),
        (
            arg("enable_prefill_cp", False) or attn_cp > 1,
            "prefill context parallelism (--enable-prefill-cp / --attn-cp-size) splits prefill "
            "tokens across ranks; drop it",
        ),
    ]
    for broken, message in rules:
        if broken:
            raise DumpConfigError(f"{ENV_DIR} is set but {message}")


def text_config(hf_config):
    """The text model's config of a model or of a multimodal wrapper (``text_config``)."""
    return getattr(hf_config, "text_config", None) or hf_config


SUPPORTED_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "KimiK25ForConditionalGeneration",
)


def check_model(architectures: Sequence[str], num_layers: int, settings: "DumpSettings") -> List[int]:
    """The dump's EAGLE-3 ids for this model, or a refusal naming the fix."""
    arch = (list(architectures) or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise DumpConfigError(
            f"{ENV_DIR} is set but {arch} is not supported; the dump covers DeepSeek-V2/V3 and "
            f"Kimi-K2.5 models: unset {ENV_DIR}"
        )
    return settings.resolved_layer_ids(num_layers)


def _model_config(server_args):
    try:
        from sglang.srt.arg_groups.model_override_base import model_config_of

        return model_config_of(server_args)
    except (ImportError, AttributeError):
        return server_args.get_model_config()


def check_launch(server_args) -> None:
    """Called by the launching process (``launch_server`` and ``Engine``) before any worker
    starts or any weight loads: a setting under which the dump would be wrong ends the launch
    with one line (``SystemExit``: no traceback) and a non-zero exit."""
    try:
        settings = DumpSettings.from_env()
        if settings is None:
            return
        check_server_args(server_args)
        hf_config = _model_config(server_args).hf_config
        check_model(getattr(hf_config, "architectures", None) or [],
                    text_config(hf_config).num_hidden_layers, settings)
        check_directory(settings.directory)
    except DumpConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
