"""The public API: thin functions over one process-wide :class:`~trainguard.client.Client`.

Every function here is safe to call at any time — before ``init``, after ``shutdown``, twice, from any
thread, with any arguments — and never raises into the training loop. Without an endpoint (argument or
``TRAINGUARD_ENDPOINT``) the SDK stays disabled and each call returns at once.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Dict, List, Mapping, Optional
from urllib.parse import quote, unquote, urlsplit

from .client import Client
from .guard import never_raise, warn_once
from .integrations.base import DidNotEnable, Integration
from .integrations.exit import ExitIntegration
from .integrations.logging import LoggingIntegration
from .options import build_options
from .version import torch_version_problem

_client: Optional[Client] = None
_integrations: List[Integration] = []
_lock = threading.RLock()


@never_raise()
def init(endpoint: Optional[str] = None, project: Optional[str] = None, token: Optional[str] = None,
         run_name: Optional[str] = None, tags: Optional[Mapping[str, Any]] = None,
         **options: Any) -> None:
    """Start reporting this process's run to ``endpoint``.

    ``endpoint``: ``http(s)://host:port``, ``grpc://host:port`` (``trainguard[grpc]``) or
    ``file:///path.jsonl``; None falls back to ``TRAINGUARD_ENDPOINT``, and without either the SDK is a
    no-op. Every other option is documented in :class:`trainguard.options.Options` and may also come from
    ``TRAINGUARD_<OPTION>``. Calling ``init`` again flushes and replaces the previous client.
    """
    global _client
    explicit: Dict[str, Any] = dict(options)
    explicit.update({"endpoint": endpoint, "project": project, "token": token, "run_name": run_name,
                     "tags": tags})
    opts, problems = build_options(explicit, os.environ)
    for problem in problems:
        warn_once(f"option:{problem}", problem)
    with _lock:
        if _client is not None:
            warn_once("init-twice", "init() called again: the previous client was flushed and replaced")
            _shutdown_locked(timeout=min(2.0, _client.options.shutdown_timeout))
        if not opts.endpoint:
            return
        try:
            client = Client(opts)
        except ValueError as exc:
            warn_once("endpoint", f"{exc}; the SDK is disabled")
            return
        _client = client
        for integration in (ExitIntegration(), LoggingIntegration()):
            try:
                integration.setup(client)
            except DidNotEnable as exc:
                warn_once(f"integration:{integration.identifier}", f"{integration.identifier}: {exc}")
                continue
            _integrations.append(integration)
        if "torch" in sys.modules:  # OOM context even without watch(); never imports torch itself
            try:
                from .integrations.cuda_memory import install_oom_enricher

                install_oom_enricher(client)
            except Exception as exc:
                warn_once("integration:oom", f"OOM capture not installed: {exc}")
        announce = opts.announce if opts.announce is not None else _stderr_is_terminal()
        if announce and client.identity.rank == 0:
            _announce(client)  # before anything is sent, so it is the SDK's first line
        client.capture_lifecycle_start()


def dashboard_link(endpoint: str, run_id: str, dashboard_url: Optional[str] = None) -> str:
    """Where the run's dashboard page is: ``dashboard_url`` (or, by default, the endpoint's host on HTTP port
    4318; an ``http(s)://`` endpoint's own port) + ``/ui/#/runs/<run id>``; a ``file://`` endpoint: its
    path. Empty when the endpoint says nothing usable."""
    parts = urlsplit(endpoint)
    if parts.scheme == "file":
        return unquote(parts.path)
    base = (dashboard_url or "").rstrip("/")
    if not base:
        host = parts.hostname or ""
        if not host:
            return ""
        if parts.scheme in ("http", "https"):
            base = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path.rstrip('/')}"
        else:  # grpc(s): the dashboard is served by the HTTP side, 4318 unless told
            host = f"[{host}]" if ":" in host else host
            base = f"{'https' if parts.scheme == 'grpcs' else 'http'}://{host}:4318"
    return f"{base}/ui/#/runs/{quote(run_id, safe='')}"


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except Exception:  # closed, or replaced by an object without isatty
        return False


def _announce(client: Client) -> None:
    """One line on stderr: the run and where to watch it (``announce`` option, rank 0)."""
    ident = client.identity
    link = dashboard_link(client.options.endpoint or "", ident.run_id, client.options.dashboard_url)
    where = f"events in {link}" if link.startswith("/") else link or client.options.endpoint
    try:
        sys.stderr.write(f"trainguard: run {ident.run_name} ({ident.run_id}): {where}\n")
        sys.stderr.flush()
    except Exception:  # stderr closed or unencodable: the line is a courtesy
        pass


def log(step: Optional[int] = None, **metrics: Any) -> None:
    """Record scalar metrics at ``step`` (default: the current step). Costs ~1 µs; never blocks.

    Values may be floats, ints, bools, numpy scalars or one-element torch tensors (read back on the
    SDK's thread, never synchronising the training step). NaN and Inf are legal and are reported at
    once with the recent history of every metric.
    """
    client = _client
    if client is None:
        return
    try:
        if step is not None and type(step) is not int:
            try:
                step = int(step)
            except (TypeError, ValueError):
                client.stats.drop("invalid_value", len(metrics))
                warn_once("log:step", f"log(step={step!r}): step must be an integer; call dropped")
                return
        client.log_metrics(step, metrics)
    except Exception as exc:  # never into user code
        warn_once(f"log:{type(exc).__name__}", f"log() failed ({type(exc).__name__}: {exc}); continuing")


@never_raise()
def capture_exception(exc: Optional[BaseException] = None) -> Optional[str]:
    """Report ``exc`` (default: the exception being handled) as a handled error; returns its event id."""
    client = _client
    if client is None:
        return None
    if exc is None:
        exc = sys.exc_info()[1]
        if exc is None:
            return None
    return client.capture_exception(exc, handled=True, mechanism="capture_exception")


@never_raise()
def watch(model: Any, optimizer: Any = None, scaler: Any = None, clip: Optional[float] = None,
          every: Optional[int] = None, **kwargs: Any) -> Any:
    """Hook ``model``/``optimizer`` for loss-independent training signals (uses the job's torch, 2.1 to 2.x;
    outside that range one warning says so, and nothing is raised).

    Gradient L2 norms (global and per layer, fused on the device, read back off the step path), clip
    triggers when ``clip`` is known, the GradScaler's scale, step time, and CUDA memory every
    ``memory_every`` steps. ``every`` overrides ``per_layer_every``. Returns a handle with ``remove()``.
    """
    client = _client
    if client is None:
        return None
    try:
        from .integrations.torch import watch as torch_watch
    except DidNotEnable:  # no torch in this process
        warn_once("watch:torch", "watch(): torch is not installed in this process (TrainGuard uses the job's "
                                 "torch and never installs one); not watching")
        return None
    problem = torch_version_problem(getattr(sys.modules.get("torch"), "__version__", "?"))
    if problem:
        warn_once("watch:torch-version", problem)
    return torch_watch(client, model, optimizer=optimizer, scaler=scaler, clip=clip, every=every,
                       **kwargs)


def check_batch(input_ids: Any, attention_mask: Any = None, *, pad_id: Optional[int] = None,
                eos_id: Optional[int] = None, labels: Any = None, max_length: Optional[int] = None,
                padding_side: str = "auto", ignore_index: int = -100, every: Optional[int] = None,
                step: Optional[int] = None, tokenizer: Any = None) -> None:
    """Check a token batch for padding the model attends to, a mask that disagrees with the padding, and
    EOS cut off by truncation (the job's torch); reports ``seq/*`` metrics. Never blocks, never raises.

    ``input_ids``: a ``(batch, length)`` tensor (or a dict / ``BatchEncoding`` holding ``input_ids``,
    ``attention_mask`` and ``labels``). ``attention_mask``: what the model will get (None: the model gets
    none, so every pad is attended). ``pad_id`` (required, or taken from ``tokenizer.pad_token_id``) and
    ``eos_id`` (``tokenizer.eos_token_id``; None: no EOS checks) are token ids; ``pad_id == eos_id`` is
    understood. ``labels``: token-level labels of the ids' shape (``ignore_index`` marks ignored ones).
    ``max_length``: the truncation length (default: the batch's width). ``padding_side``: ``"auto"``
    (inferred per batch on the device), ``"left"`` or ``"right"`` (``tokenizer.padding_side`` when given).
    ``every``: check one call in N (the first always); None (default): every call while a check costs
    less than the ``watch_overhead_budget`` option (0.5%) of the time between calls, else one in N (N <=
    16), adapted as it goes. ``step``: default the step this batch is about to
    be trained in (the last step logged + 1): call it before the step's ``log``, or pass ``step=``.

    Metrics (shares of the batch's rows): ``seq/pad_attended_frac``, ``seq/mask_mismatch_frac``,
    ``seq/truncated_frac`` (reaching max_length without EOS), ``seq/eos_missing_frac``,
    ``seq/labels_on_pad_frac``; computed on the batch's device and read back on the SDK's thread, never
    synchronising the training step (~0.13 ms of host time per checked 16x64 batch on a CPU; see
    :mod:`trainguard.integrations.sequence`). Unreadable input is skipped with one warning and counted
    (``invalid_value``).
    """
    client = _client
    if client is None:
        return
    try:
        from .integrations.sequence import check_batch as check

        check(client, input_ids, attention_mask, pad_id=pad_id, eos_id=eos_id, labels=labels,
              max_length=max_length, padding_side=padding_side, ignore_index=ignore_index, every=every,
              step=step, tokenizer=tokenizer)
    except ValueError as exc:  # input it cannot read
        client.stats.drop("invalid_value")
        warn_once(f"check_batch:{str(exc)[:40]}", f"check_batch(): {exc}; batch not checked (counted)")
    except Exception as exc:  # never into user code
        client.stats.drop("invalid_value")
        warn_once(f"check_batch:{type(exc).__name__}",
                  f"check_batch() failed ({type(exc).__name__}: {exc}); batch not checked (counted)")


@never_raise()
def watch_lora(model: Any, every: int = 1, *, name_filter: Any = None, a_names: Any = None,
               b_names: Any = None, optimizer: Any = None) -> Any:
    """Report whether ``model``'s LoRA adapters get gradients (the job's torch).

    Adapters are found by name (peft's ``lora_A``/``lora_B``, ``lora_embedding_A``/``_B``; other names
    through ``a_names``/``b_names``), narrowed by ``name_filter`` (a regex or ``name -> bool``). At the end
    of every ``every``-th backward pass: ``lora/grad_mean_A``, ``lora/grad_mean_B`` (mean |grad|),
    ``lora/no_grad_params`` (adapter params with no gradient at all) and ``lora/params``, fused on the
    device and read back on the SDK's thread. ``optimizer`` (optional): its step is the fallback trigger.
    Returns a handle with ``remove()``. See :mod:`trainguard.integrations.lora`.
    """
    client = _client
    if client is None:
        return None
    from .integrations.lora import A_NAMES, B_NAMES
    from .integrations.lora import watch_lora as lora_watch

    return lora_watch(client, model, every, name_filter=name_filter,
                      a_names=A_NAMES if a_names is None else tuple(a_names),
                      b_names=B_NAMES if b_names is None else tuple(b_names), optimizer=optimizer)


@never_raise(default=False)
def flush(timeout: float = 5.0) -> bool:
    """Wait up to ``timeout`` s for delivery of everything recorded so far; True if all arrived."""
    client = _client
    if client is None:
        return True
    return client.flush(timeout)


@never_raise()
def shutdown(timeout: Optional[float] = None) -> None:
    """Flush (bounded by ``timeout``, default ``shutdown_timeout``) and disable the SDK."""
    with _lock:
        _shutdown_locked(timeout)


def _shutdown_locked(timeout: Optional[float]) -> None:
    global _client
    client = _client
    if client is None:
        return
    _client = None
    torch_integration = sys.modules.get("trainguard.integrations.torch")
    if torch_integration is not None:
        try:
            torch_integration.unwatch_all(client)
        except Exception:
            pass
    lora_integration = sys.modules.get("trainguard.integrations.lora")
    if lora_integration is not None:
        try:
            lora_integration.unwatch_all(client)
        except Exception:
            pass
    for integration in reversed(_integrations):
        try:
            integration.teardown()
        except Exception:
            pass
    _integrations.clear()
    client.close(client.options.shutdown_timeout if timeout is None else timeout)


def get_client() -> Optional[Client]:
    """The active client, or None when the SDK is disabled."""
    return _client


def _after_fork_in_child() -> None:
    client = _client
    if client is not None:
        try:
            client.after_fork_in_child()
        except Exception:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
