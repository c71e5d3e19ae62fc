"""`kuiper serve`: the click command. FastAPI and uvicorn are imported when it runs, not when the CLI starts."""
from __future__ import annotations

import importlib
import signal
import socket
import sys
from pathlib import Path

import click

from ..errors import KuiperError
from ..parallel import TP_HELP


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so a taken port is one clear error (and --port 0 picks a free one)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise KuiperError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise KuiperError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _log_config(verbose: bool) -> dict:
    """uvicorn's logs (and, with -v, its access lines) on stderr: stdout stays free."""
    level = "INFO" if verbose else "WARNING"
    handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "plain"}
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"plain": {"format": "kuiper serve: %(message)s"}},
            "handlers": {"stderr": handler},
            "loggers": {"uvicorn": {"handlers": ["stderr"], "level": level, "propagate": False},
                        "uvicorn.error": {"level": level},
                        "uvicorn.access": {"handlers": ["stderr"] if verbose else [], "level": level,
                                           "propagate": False}}}


@click.command("serve")
@click.option("-m", "--model", required=True, type=click.Path(),
              help="ak48 .bin file, Hugging Face directory or hub id (exported once into the kuiper cache).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port (0 picks a free one).")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--max-context", type=int, default=None,
              help="KV cache positions: prompt and completion together (default: the model's maximum).")
@click.option("--max-queue", type=int, default=64, show_default=True,
              help="Requests that may wait for the engine; more get 503 with Retry-After.")
@click.option("--served-model-name", default=None,
              help="The model name the API shows (default: the hub id, else the file's or directory's name).")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(), default=None,
              help="Hugging Face directory with tokenizer.json (for plain v5 files).")
@click.option("--draft", type=str, default=None,
              help="Speculative decoding with this smaller model (ak48 file, HF directory or hub id) of the same "
                   "tokenizer, loaded once on the model's device.")
@click.option("--lookup", type=int, default=None,
              help="Speculative decoding by prompt lookup: guess the continuation of the latest earlier occurrence "
                   "of the last N tokens.")
@click.option("--draft-tokens", type=int, default=None,
              help="Tokens guessed per verify step with --draft or --lookup (default 4).")
@click.option("--max-num-seqs", type=int, default=1, show_default=True,
              help="Requests stepped together (continuous batching over a paged KV cache, docs/BATCHING.md); 1 runs "
                   "them one at a time.")
@click.option("--gpu-memory-utilization", "utilization", type=float, default=None,
              help="(--max-num-seqs > 1) The share of free device memory (host memory on the CPU) the KV block pool "
                   "may take, in (0, 1] (default 0.5).")
@click.option("--max-num-batched-tokens", "step_tokens", type=int, default=None,
              help="(--max-num-seqs > 1) Tokens one step may run, at least --max-num-seqs (default: --max-num-seqs "
                   "+ --chunked-prefill-size).")
@click.option("--chunked-prefill-size", "chunk_size", type=int, default=None,
              help="(--max-num-seqs > 1) Prompt tokens a request prefills per step (default 256).")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", "prefix_caching", default=None,
              help="(--max-num-seqs > 1) Share the KV blocks of identical prompt prefixes between requests "
                   "(default: on).")
@click.option("--tp", type=int, default=1, show_default=True, help=TP_HELP)
@click.option("-v", "--verbose", is_flag=True, help="Log each HTTP request on stderr.")
def serve(model, host, port, device, max_context, max_queue, served_model_name, tokenizer_dir, draft, lookup,
          draft_tokens, max_num_seqs, utilization, step_tokens, chunk_size, prefix_caching, tp, verbose):
    """An OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.
    Requests run on one engine thread, queued: one at a time, or up to --max-num-seqs stepped together (continuous
    batching, set by the four options after it); SIGINT/SIGTERM stop it cleanly (exit 0). With --draft
    or --lookup each reply is decoded speculatively (requests asking for logprobs are decoded plainly)."""
    from ..cli import _check_speculative  # (here: kuiper_py.cli imports this module)
    draft = _check_speculative(draft, lookup, draft_tokens)
    if max_context is not None and max_context <= 0:
        raise KuiperError(f"--max-context {max_context} must be positive")
    if max_num_seqs < 1:
        raise KuiperError(f"--max-num-seqs {max_num_seqs} must be >= 1")
    if max_num_seqs > 1 and (draft is not None or lookup is not None):
        raise KuiperError("--max-num-seqs > 1 and speculative decoding (--draft/--lookup) cannot be combined yet")
    if max_num_seqs > 1 and tp > 1:
        raise KuiperError(f"--max-num-seqs > 1 and --tp {tp} cannot be combined yet")
    batching = _batching(max_num_seqs, utilization, step_tokens, chunk_size, prefix_caching)
    if max_queue < 1:
        raise KuiperError(f"--max-queue {max_queue} must be >= 1")
    if not 0 <= port <= 65535:
        raise KuiperError(f"--port {port} must be in 0..65535")
    try:  # the serve extra's packages (optional: a plain install has no HTTP stack); kuiper's own imports follow
        for extra in ("fastapi", "pydantic", "prometheus_client", "uvicorn"):
            importlib.import_module(extra)
    except ModuleNotFoundError as e:
        raise KuiperError(f"kuiper serve needs the serve extra (FastAPI, uvicorn, pydantic, prometheus-client): "
                          f"pip install 'kuiper[serve]' ({e.name} is missing)") from None
    import uvicorn

    from ..hub import is_hub_id, resolve_model
    from .app import create_app
    from .engine_worker import EngineWorker
    from .metrics import Metrics

    path = resolve_model(model)  # (before listening: an export's progress and errors come first)
    from ..generate import ops_class, pick_device
    dev = pick_device(device)  # (before listening too: what this device cannot run)
    if max_num_seqs > 1 and ops_class(dev).max_batch < 2:
        raise KuiperError(f"--max-num-seqs {max_num_seqs}: the {dev} backend runs one sequence a step")
    if tp != 1:  # (a --tp the model's shapes or the device refuse)
        from ..loader import load
        from ..parallel.group import check_request
        check_request(load(path), tp, dev)
    sock = _listen(host, port)
    name = served_model_name or (model if is_hub_id(model) else Path(model).stem)  # (as vLLM: the hub id)
    worker = EngineWorker(str(path), device, max_context, max_queue, Metrics(), tokenizer_dir, tp=tp,
                          max_seqs=max_num_seqs, draft=draft, lookup=lookup, draft_tokens=draft_tokens,
                          batching=batching)
    app = create_app(worker, name)
    config = uvicorn.Config(app, log_config=_log_config(verbose), timeout_graceful_shutdown=30,
                            timeout_keep_alive=5)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            worker.drain()  # (queued requests end now; the running one finishes, within the grace period)
            super().handle_exit(sig, frame)

    server = Server(config)
    worker.on_failure = lambda: setattr(server, "should_exit", True)
    bound = sock.getsockname()
    click.echo(f"kuiper serve: {name} on http://{host}:{bound[1]} (loading the model; /health answers 200 once "
               f"it is ready)", err=True)
    # uvicorn re-raises the signal that stopped it once its own handlers are gone: handlers of ours that do
    # nothing then take it, so a SIGTERM or SIGINT ends the command with exit 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    # the engine thread hands each token over with the GIL held between GPU waits: a short switch interval lets
    # the event loop send it without waiting out Python's default 5 ms
    sys.setswitchinterval(0.001)
    worker.start()
    _announce_ready(worker, host, bound[1])
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
        sock.close()
    e = worker.load_error
    if e is not None:
        raise e if isinstance(e, KuiperError) else KuiperError(worker.error)
    click.echo("kuiper serve: stopped", err=True)


def _batching(max_num_seqs: int, utilization, step_tokens, chunk_size, prefix_caching) -> dict:
    """The BatchConfig settings the batching options give (those left out keep BatchConfig's defaults), refused in
    one line when out of range or given where requests run one at a time (which always reuses a cached prefix)."""
    given = {"--gpu-memory-utilization": utilization, "--max-num-batched-tokens": step_tokens,
             "--chunked-prefill-size": chunk_size,
             "--no-enable-prefix-caching": True if prefix_caching is False else None}
    if max_num_seqs == 1:
        named = [flag for flag, v in given.items() if v is not None]
        if named:
            raise KuiperError(f"{', '.join(named)} appl{'ies' if len(named) == 1 else 'y'} only to requests stepped "
                              f"together: add --max-num-seqs N (N > 1)")
        return {}
    if utilization is not None and not 0 < utilization <= 1:
        raise KuiperError(f"--gpu-memory-utilization {utilization} must be in (0, 1]")
    if chunk_size is not None and chunk_size < 1:
        raise KuiperError(f"--chunked-prefill-size {chunk_size} must be >= 1")
    if step_tokens is not None and step_tokens < max_num_seqs:
        raise KuiperError(f"--max-num-batched-tokens {step_tokens} must be at least --max-num-seqs {max_num_seqs} "
                          f"(a step holds the next token of every running request)")
    out = {"utilization": utilization, "step_tokens": step_tokens, "chunk_size": chunk_size,
           "prefix_caching": prefix_caching}
    return {k: v for k, v in out.items() if v is not None}


def _announce_ready(worker, host: str, port: int) -> None:
    """A line on stderr once the model is loaded (from a helper thread: the engine thread only runs the model)."""
    import threading

    def wait():
        worker.ready.wait()
        spec = "" if worker.proposer is None else f", speculative: {worker.draft_tokens} guesses per step by " + (
            f"prompt lookup of {worker.lookup} tokens" if worker.lookup else f"the draft {Path(worker.draft).name}")
        click.echo(f"kuiper serve: ready on http://{host}:{port} ({worker.engine.device}, context "
                   f"{worker.max_context} tokens{spec}{_batch_summary(worker.batch)})", err=True)
    threading.Thread(target=wait, daemon=True).start()


def _batch_summary(be) -> str:
    """The ready line's account of the batching settings in force (empty when requests run one at a time)."""
    if be is None:
        return ""
    pool, sched = be.pool, be.sched
    return (f"; batching up to {sched.max_seqs} requests, {sched.step_tokens} tokens a step, prefill chunks of "
            f"{sched.chunk_size}, a KV pool of {pool.n_blocks} blocks of {pool.block_size} positions, prefix caching "
            f"{'on' if pool.prefix_caching else 'off'}")
