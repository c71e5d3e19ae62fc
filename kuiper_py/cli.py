"""The `kuiper` command line. stdout carries generated text or JSON only; everything else goes to stderr."""
from __future__ import annotations

import errno
import itertools
import json
import os
import secrets
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import click

from .errors import KuiperError

DEBUG = {"on": False}
ARGV: list[str] = []  # the arguments as typed, so an error names a flag the way the user wrote it
CTX_FLAGS = ("-c", "--ctx-size", "--max-context")


def _err(msg: str) -> None:
    click.echo(f"kuiper: error: {msg}", err=True)


def _typed(*opts: str) -> str:
    """The one of a flag's spellings the user typed (the last one typed), else all of them joined by '/'."""
    hit = None
    for a in ARGV:
        for o in opts:
            if a == o or (o.startswith("--") and a.startswith(o + "=")) or (len(o) == 2 and a.startswith(o)
                                                                               and not a.startswith("--")):
                hit = o
    return hit or "/".join(opts[:2])


def _retag(msg: str) -> str:
    """The engine's messages name the context flag --max-context: name it as this command line typed it."""
    return msg.replace("--max-context", _typed(*CTX_FLAGS)) if "--max-context" in msg else msg


def main(argv=None) -> None:
    """Entry point: one line and an exit code for every failure; a traceback only under --debug."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ARGV[:] = argv
    DEBUG["on"] = "--debug" in argv or os.environ.get("KUIPER_DEBUG") == "1"
    if hasattr(signal, "SIGXFSZ"):  # a file-size limit should fail the write (EFBIG), not kill us
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if not argv:  # `kuiper` alone: the help, as `git` or `llama-cli -h` give it
        click.echo(cli.get_help(click.Context(cli, info_name="kuiper", **cli.context_settings)))
        sys.exit(0)
    try:
        rc = cli.main(args=argv, prog_name="kuiper", standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("\nkuiper: interrupted", err=True)
        sys.exit(130)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        _err(e.format_message())
        sys.exit(2)
    except KuiperError as e:
        _trace()
        _err(_retag(str(e)))
        sys.exit(e.exit_code)
    except MemoryError:
        _trace()
        _err("out of host memory")
        sys.exit(3)
    except BrokenPipeError:
        sys.stderr.close()
        sys.exit(0)
    except OSError as e:
        _trace()
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.ENOMEM):
            _err(f"out of resources: {e.strerror}")
            sys.exit(3)
        _err(f"{e.strerror or e}{': ' + str(e.filename) if e.filename else ''}")
        sys.exit(2)
    except Exception as e:  # noqa: BLE001 - the last line of defence turns a bug into one line
        _trace()
        if type(e).__name__ == "OutOfMemoryError":  # cupy.cuda.memory.OutOfMemoryError
            _err(f"out of GPU memory: {e} (try a smaller {_typed(*CTX_FLAGS)})")
            sys.exit(3)
        hint = "" if DEBUG["on"] else " (rerun with --debug for a traceback)"
        _err(f"internal error: {type(e).__name__}: {e}{hint}")
        sys.exit(1)


def _trace() -> None:
    if DEBUG["on"]:
        traceback.print_exc()


def _set_debug(ctx, param, value) -> None:
    if value:
        DEBUG["on"] = True


def _command(name: str):
    """A subcommand that also takes --debug after its name (`kuiper generate ... --debug`)."""
    def wrap(f):
        f = click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
                         help="Show tracebacks for errors.")(f)
        return cli.command(name)(f)
    return wrap


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for errors (also accepted after the command).")
@click.version_option(package_name="kuiper", prog_name="kuiper")
def cli(debug: bool) -> None:
    """kuiper: Qwen3 AWQ inference from one ak48 file.

    No weights yet? `kuiper synth tiny --preset tiny`, `kuiper export tiny -o tiny.bin`, then
    `kuiper generate -m tiny.bin -p "Hello"` (random weights: the text is gibberish, the engine is real)."""


def _check_writable_dir(output: str) -> None:
    """Refuse an output file whose directory cannot take a new file, before any work: a trial file there."""
    import tempfile
    d = Path(output).resolve().parent
    if not d.is_dir():
        raise KuiperError(f"-o {output}: directory {d} does not exist")
    try:
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as e:
        why = "this file system does not take new files" if e.errno == errno.ENOENT else e.strerror
        raise KuiperError(f"-o {output}: cannot write to {d}: {why}") from None


def _resolve(model: str) -> str:
    """-m's argument as a file: an ak48 file as is; a Hugging Face directory or hub id exported once into the
    kuiper cache (kuiper_py.hub)."""
    from .hub import resolve_model
    return str(resolve_model(model))


@_command("export")
@click.argument("hf_dir", type=str)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Output .bin file.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def export_cmd(hf_dir: str, output: str, quiet: bool) -> None:
    """Convert a Hugging Face Qwen3 4-bit checkpoint (AWQ, GPTQ or compressed-tensors; a directory or a hub id such
    as Qwen/Qwen3-8B-AWQ) to an ak48 .bin file."""
    from .export import export
    _check_writable_dir(output)
    export(hf_dir, output, progress=not quiet)


def _sampling_options(f):
    for opt in reversed([
        click.option("--temp", type=float, default=None, help="Temperature; 0 = greedy. Default: generation_config."),
        click.option("--top-k", type=int, default=None, help="Top-k (0 = off)."),
        click.option("--top-p", type=float, default=None, help="Top-p nucleus mass (1 = off)."),
        click.option("--min-p", type=float, default=None, help="Min-p relative to the top token (0 = off)."),
        click.option("--repeat-penalty", type=float, default=None, help="Repetition penalty (1 = off)."),
        click.option("--repeat-last-n", type=int, default=None, help="Tokens the repetition penalty looks back over."),
        click.option("--seed", type=int, default=-1, show_default=True,
                     help="Random seed for sampling; -1 draws one (reported in the statistics line and --json)."),
        click.option("-t", "--threads", type=int, default=None,
                     help="CPU threads of the CPU engine's BLAS (default: all cores)."),
    ]):
        f = opt(f)
    return f


def _sampling(overrides: dict):
    """The sampling flags checked before any loading (their messages name the flags), and the seed resolved."""
    from .sampling import SamplingParams
    seed = overrides["seed"]
    if seed < -1:
        raise KuiperError(f"--seed {seed} must be >= 0, or -1 for a random seed")
    overrides["seed"] = secrets.randbelow(2**32) if seed == -1 else seed
    SamplingParams(**{k: v for k, v in overrides.items() if v is not None}).validate()
    return overrides


def _params(eng, overrides: dict):
    from .sampling import SamplingParams
    return SamplingParams.from_generation_config((eng.file.trailer or {}).get("generation_config"), **overrides)


def _set_threads(n: int | None) -> None:
    """-t: the BLAS thread count of the CPU engine. Set through the BLAS libraries' environment variables when
    NumPy is not loaded yet (the CLI's case), else through threadpoolctl where it is installed."""
    if n is None:
        return
    if n < 1:
        raise KuiperError(f"{_typed('-t', '--threads')} {n} must be >= 1")
    if "numpy" not in sys.modules:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS"):
            os.environ[var] = str(n)
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        click.echo("kuiper: notice: -t/--threads has no effect here (NumPy was already loaded; "
                   "pip install threadpoolctl)", err=True)
        return
    _LIMITS.append(threadpool_limits(limits=n))


_LIMITS: list = []  # threadpoolctl's limits, held for the life of the process


def _model_header(path: str):
    """The model file's header alone (a 256-byte read), for checking flags against the model before loading it;
    None when it cannot be read, so the loader reports that."""
    from . import format as fmt
    try:
        with open(path, "rb") as f:
            return fmt.Header.unpack(f.read(fmt.HEADER_SIZE))
    except OSError:
        return None


def _check_ctx(ctx_size: int | None, header) -> None:
    if ctx_size is None:
        return
    top = header.max_seq_len if header is not None else None
    if ctx_size < 1 or (top is not None and ctx_size > top):
        raise KuiperError(f"{_typed(*CTX_FLAGS)} {ctx_size} must be in 1..{top or 'the model maximum'}"
                          + (" (the model's context length)" if top else ""))


def _check_max_tokens(n: int) -> None:
    """One rule for generate and chat: at least one token (bench's -n 0 skips a test; a zero-token reply is not one)."""
    if n < 1:
        raise KuiperError(f"-n/--max-tokens {n} must be >= 1")


def _read_prompt(prompt: str | None, file: str | None) -> str:
    if (prompt is None) == (file is None):
        raise KuiperError("give exactly one of -p/--prompt (or -p - for stdin) and -f/--file")
    try:
        if file is not None:
            with open(file, "rb") as fh:
                data = fh.read()
        elif prompt == "-":
            data = sys.stdin.buffer.read()
        else:
            return prompt
    except OSError as e:
        raise KuiperError(f"cannot read prompt file {file}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KuiperError(f"prompt is not valid UTF-8 (byte {e.start})") from None


def _peak_host_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Ticker:
    """A line on stderr that counts the seconds of a long wait (a CPU prefill), shown only on a terminal and only
    after `delay` seconds: someone watching learns that work goes on; logs and short waits stay clean."""

    def __init__(self, label: str, delay: float = 1.0):
        self.label, self.delay = label, delay
        self._stop = threading.Event()
        self._thread = None
        self.shown = False

    def __enter__(self):
        if sys.stderr.isatty():
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        if self._stop.wait(self.delay):
            return
        while not self._stop.is_set():
            sys.stderr.write(f"\r{self.label} {time.perf_counter() - t0:.0f} s")
            sys.stderr.flush()
            self.shown = True
            self._stop.wait(0.5)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if self.shown:
                sys.stderr.write("\r\033[K")
                sys.stderr.flush()
        return False


def _echo_records(records, as_json: bool, label: str = "prefill") -> tuple:
    """Consume generate()'s records, each one's text streamed to stdout unless as_json: (the last record or None,
    the texts, whether Ctrl-C stopped it). A terminal sees a ticker while the first record (the prefill) is due."""
    last, pieces = None, []
    it = iter(records)
    try:
        with Ticker(label):
            first = next(it, None)
        for r in itertools.chain([first] if first is not None else [], it):
            last = r
            if r.text:
                pieces.append(r.text)
                if not as_json:
                    sys.stdout.write(r.text)
                    sys.stdout.flush()
    except KeyboardInterrupt:
        return last, pieces, True
    return last, pieces, False


def _timings(r, chat=None) -> dict:
    """A generation's last record's prompt and generation figures, as the --json records give them (a speculative
    chat's: with its last reply's guesses)."""
    spec = {"speculative": chat.stats.as_dict()} if chat is not None and chat.stats is not None else {}
    return {**spec, "prompt_s": round(r.prompt_seconds, 4),
            "prompt_tok_s": round(r.prompt_tokens / max(r.prompt_seconds, 1e-9), 2),
            "generated_tokens": r.gen_tokens, "gen_s": round(r.gen_seconds, 4),
            "gen_tok_s": round(r.decode_steps / max(r.gen_seconds, 1e-9), 2)}


def _speculative_options(f):
    for opt in reversed([
        click.option("--draft", type=str, default=None,
                     help="Speculative decoding with this smaller model (ak48 file, HF directory or hub id) of the "
                          "same tokenizer."),
        click.option("--lookup", type=int, default=None,
                     help="Speculative decoding by prompt lookup: guess the continuation of the latest earlier "
                          "occurrence of the last N tokens."),
        click.option("--draft-tokens", type=int, default=None,
                     help="Tokens guessed per verify step with --draft or --lookup (default 4)."),
    ]):
        f = opt(f)
    return f


def _check_speculative(draft: str | None, lookup: int | None, k: int | None) -> str | None:
    """The speculative flags checked before loading; the draft resolved to a file."""
    from .speculative import check_flags
    check_flags(draft, lookup, k)
    return None if draft is None else _resolve(draft)


def _tp_option(f):
    from .parallel import TP_HELP
    return click.option("--tp", type=int, default=1, show_default=True, help=TP_HELP)(f)


def _ctx_option(help_text: str):
    return click.option("-c", "--ctx-size", "--max-context", "ctx_size", type=int, default=None, help=help_text)


@_command("generate")
@click.option("-m", "--model", required=True, type=click.Path(), help="ak48 .bin file, Hugging Face directory or hub id.")
@click.option("-p", "--prompt", default=None, help="Prompt text, or - to read stdin.")
@click.option("-f", "--file", "prompt_file", default=None, type=click.Path(), help="Read the prompt from a file.")
@click.option("-n", "--max-tokens", type=int, default=256, show_default=True, help="Tokens to generate at most (>= 1).")
@_sampling_options
@click.option("--stop", multiple=True, help="Stop when this text is generated (repeatable).")
@click.option("--raw", is_flag=True, help="Feed the prompt as is, without the chat template.")
@click.option("--think/--no-think", default=None, help="Qwen3 thinking mode (enable_thinking); default: the template's.")
@click.option("--system", default=None, help="System message for the chat template.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@_ctx_option("KV cache positions (default: prompt + max tokens, at most the model's context length).")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(), default=None,
              help="Hugging Face directory with tokenizer.json (for plain v5 files).")
@_speculative_options
@_tp_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON record instead of streaming text.")
@click.option("-v", "--verbose", is_flag=True, help="Also log the model, sampling and prompt size before generating.")
@click.option("-q", "--quiet", is_flag=True, help="No statistics line on stderr.")
def generate_cmd(model, prompt, prompt_file, max_tokens, temp, top_k, top_p, min_p, repeat_penalty,
                 repeat_last_n, seed, threads, stop, raw, think, system, device, ctx_size, tokenizer_dir, draft,
                 lookup, draft_tokens, tp, as_json, verbose, quiet):
    """Generate text from a prompt, streaming it to stdout; a statistics line follows on stderr (-q: none)."""
    _set_threads(threads)
    _check_max_tokens(max_tokens)
    if raw and (system is not None or think is not None):
        raise KuiperError("--system and --think/--no-think need the chat template; drop --raw")
    overrides = _sampling(dict(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                               repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed))
    _check_ctx(ctx_size, None)  # (its lower bound before a hub model is fetched; the upper once the file is read)
    model = _resolve(model)
    header = _model_header(model)
    _check_ctx(ctx_size, header)
    text = _read_prompt(prompt, prompt_file)
    draft = _check_speculative(draft, lookup, draft_tokens)
    from . import speculative
    from .generate import Engine, generate, log

    eng = Engine.load(model, device, tokenizer_dir, tp=tp)
    tok, params = eng.tokenizer, _params(eng, overrides)
    proposer = speculative.proposer(eng, draft, lookup, tokenizer_dir)
    if raw:
        prompt_text = text
    else:
        msgs = ([{"role": "system", "content": system}] if system is not None else []) + \
               [{"role": "user", "content": text}]
        prompt_text = tok.apply_chat_template(msgs, enable_thinking=think)
    ids = tok.encode(prompt_text)
    limit = ctx_size or eng.file.args.max_position_embeddings
    if len(ids) > limit:
        raise KuiperError(f"prompt of {len(ids)} tokens does not fit a context of {limit} "
                          + (f"({_typed(*CTX_FLAGS)})" if ctx_size else "(the model's context length)"))
    if verbose:
        a = eng.file.args
        moe = f", {a.num_experts} experts, {a.num_experts_per_tok} per token" if a.num_experts else ""
        log(f"model: {eng.file.path} ({a.num_hidden_layers} layers, dim {a.hidden_size}{moe}), device {eng.device}"
            + (f", --tp {eng.tp}" if eng.tp > 1 else ""))
        log(f"sampling: {params}")
        log(f"prompt: {len(ids)} tokens")
    spec_stats = None
    if proposer is None:
        records = generate(eng, ids, max_tokens, params, list(stop), ctx_size)
    else:
        spec_stats = speculative.Stats()
        records = speculative.generate(eng, proposer, ids, max_tokens, params, draft_tokens or speculative.DEFAULT_K,
                                       list(stop), ctx_size, stats=spec_stats)
    last, pieces, interrupted = _echo_records(records, as_json, f"prefill of {len(ids)} tokens:")
    if not as_json:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if last is None:
        if interrupted:
            log("kuiper: interrupted during prefill")
            sys.exit(130)
        return
    reason = "interrupted" if interrupted else last.finish_reason
    if reason == "context":
        log(f"notice: generation stopped at the context limit ({eng.model.max_context} positions; "
            f"raise {_typed(*CTX_FLAGS)})")
    stats = _generate_stats(eng, last)
    if spec_stats is not None:
        stats["speculative"] = spec_stats.as_dict()
        if verbose:
            log(f"{speculative.summary(stats['speculative'])}, {stats['gen_tok_s']:.1f} tok/s")
    if as_json:
        click.echo(json.dumps({"text": "".join(pieces), "tokens": last.tokens, "finish_reason": reason,
                               "prompt_tokens": last.prompt_tokens, "seed": params.seed, "timings": stats},
                              ensure_ascii=False))
    if not quiet:
        log(_stats_line(stats, reason, params.seed))
    if interrupted:
        sys.exit(130)


def _generate_stats(eng, last) -> dict:
    stats = {"load_s": round(eng.load_seconds, 3), "warmup_s": round(last.warmup_seconds, 3),
             "prompt_tokens": last.prompt_tokens, **_timings(last), "peak_host_mib": round(_peak_host_mib(), 1)}
    dev = eng.model.ops.device_stats() if eng.model is not None else {}
    if dev:
        stats["gpu_mib"] = round(dev["gpu_mib"], 1)
        # waited for in the load, the warm-up and the prompt: large on a machine's first run (NVRTC), ~0.1 s after
        stats["kernel_build_s"] = round(dev["kernel_build_s"], 3)
    return stats


def _stats_line(stats: dict, reason: str, seed: int) -> str:
    build = stats.get("kernel_build_s", 0.0)
    return (f"load {stats['load_s']:.2f} s | " + (f"warm-up {stats['warmup_s']:.2f} s | " if stats["warmup_s"] else "")
            + f"prompt {stats['prompt_tokens']} tokens, {stats['prompt_tok_s']:.1f} tok/s | "
            f"generated {stats['generated_tokens']} tokens, {stats['gen_tok_s']:.1f} tok/s | finish: {reason} | "
            f"seed {seed} | peak host {stats['peak_host_mib']:.0f} MiB"
            + (f" | GPU {stats['gpu_mib']:.0f} MiB" if "gpu_mib" in stats else "")
            + (f" | accepted {stats['speculative']['accepted']} of {stats['speculative']['proposed']} guesses, "
               f"{stats['speculative']['mean_accepted_length']:.2f} tokens per step" if "speculative" in stats else "")
            + (f" | {build:.1f} s waiting for kernel builds (a first run compiles them; later runs load CuPy's disk "
               f"cache)" if build >= 1.0 else ""))


CHAT_CONTEXT = 4096  # `kuiper chat`'s default KV cache positions (or the model's maximum, if smaller)


def _read_turn(tty: bool) -> str | None:
    """The next user message from stdin: one line, or lines joined while they end in a backslash; None at the end
    of input. On a terminal a prompt goes to stderr first (stdout carries only replies)."""
    parts = []
    while True:
        if tty:
            click.echo(">>> " if not parts else "... ", nl=False, err=True)
        raw = sys.stdin.buffer.readline()
        if not raw:
            return "\n".join(parts) if parts else None
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            raise KuiperError(f"input is not valid UTF-8 (byte {e.start} of the line)") from None
        if line.endswith("\\"):
            parts.append(line[:-1])
            continue
        parts.append(line)
        return "\n".join(parts)


class _ChatTotals:
    """The whole conversation's figures, for the statistics line at its end (llama.cpp prints its timings then)."""

    def __init__(self, seed: int):
        self.seed, self.replies, self.prompt_tokens, self.prompt_s = seed, 0, 0, 0.0
        self.gen_tokens, self.steps, self.gen_s = 0, 0, 0.0

    def add(self, r) -> None:
        self.replies += 1
        self.prompt_tokens += r.prompt_tokens
        self.prompt_s += r.prompt_seconds
        self.gen_tokens += r.gen_tokens
        self.steps += r.decode_steps
        self.gen_s += r.gen_seconds

    def line(self) -> str:
        return (f"chat: {self.replies} repl{'y' if self.replies == 1 else 'ies'} | prefilled {self.prompt_tokens} "
                f"tokens, {self.prompt_tokens / max(self.prompt_s, 1e-9):.1f} tok/s | generated {self.gen_tokens} "
                f"tokens, {self.steps / max(self.gen_s, 1e-9):.1f} tok/s | seed {self.seed}")


@_command("chat")
@click.option("-m", "--model", required=True, type=click.Path(), help="ak48 .bin file, Hugging Face directory or hub id.")
@click.option("-n", "--max-tokens", type=int, default=1024, show_default=True, help="Tokens per reply at most (>= 1).")
@_sampling_options
@click.option("--stop", multiple=True, help="End a reply when this text is generated (repeatable).")
@click.option("--think/--no-think", default=None, help="Qwen3 thinking mode (enable_thinking); default: the template's.")
@click.option("--system", default=None, help="System message, kept for the whole chat.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@_ctx_option(f"KV cache positions for the whole conversation (default {CHAT_CONTEXT}, or the model's maximum).")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(), default=None,
              help="Hugging Face directory with tokenizer.json (for plain v5 files).")
@_speculative_options
@_tp_option
@click.option("--json", "as_json", is_flag=True, help="One JSON line per reply instead of streaming text.")
@click.option("-v", "--verbose", is_flag=True, help="A line of statistics per reply on stderr.")
@click.option("-q", "--quiet", is_flag=True, help="No statistics line at the end of the chat.")
def chat_cmd(model, max_tokens, temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed, threads, stop, think,
             system, device, ctx_size, tokenizer_dir, draft, lookup, draft_tokens, tp, as_json, verbose, quiet):
    """Chat on one KV cache: each line of stdin is a user message (a line ending in a backslash continues on
    the next), and each turn prefills only the tokens the cache does not already hold. /reset starts over;
    /exit or the end of input quits. Replies go to stdout, everything else to stderr."""
    _set_threads(threads)
    _check_max_tokens(max_tokens)
    overrides = _sampling(dict(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                               repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed))
    _check_ctx(ctx_size, None)
    model = _resolve(model)
    _check_ctx(ctx_size, _model_header(model))
    draft = _check_speculative(draft, lookup, draft_tokens)
    from . import speculative
    from .generate import Chat, Engine, log

    eng = Engine.load(model, device, tokenizer_dir, tp=tp)
    params = _params(eng, overrides)
    proposer = speculative.proposer(eng, draft, lookup, tokenizer_dir)
    ctx = ctx_size or min(CHAT_CONTEXT, eng.file.args.max_position_embeddings)
    eng.tokenizer.apply_chat_template([{"role": "user", "content": ""}])  # (no chat template: the error comes now)
    t0 = time.perf_counter()
    if proposer is None:
        chat = Chat(eng, ctx, system, think)
    else:
        chat = speculative.SpeculativeChat(eng, ctx, proposer, draft_tokens or speculative.DEFAULT_K, system=system,
                                           enable_thinking=think)
    if verbose and chat.warmed:
        log(f"captured the prefill graphs of {len(chat.warmed)} prompt lengths up to {max(chat.warmed)} tokens in "
            f"{time.perf_counter() - t0:.2f} s")
    tty = sys.stdin.isatty()
    if tty:
        log(f"kuiper chat: {eng.device}, context {ctx} tokens; /reset starts over, /exit quits, "
            f"a line ending in \\ continues")
    totals = _ChatTotals(params.seed)
    try:
        _chat_loop(chat, tty, max_tokens, params, list(stop), as_json, verbose, totals)
    finally:
        if not quiet and totals.replies:
            log(totals.line() + (" | " + speculative.summary(chat.total.as_dict()) if proposer is not None else ""))


def _chat_loop(chat, tty: bool, max_tokens: int, params, stop: list[str], as_json: bool, verbose: bool,
               totals: _ChatTotals) -> None:
    from .generate import log
    from .speculative import summary
    ctx, ctx_flag = chat.max_context, _typed(*CTX_FLAGS)
    while True:
        text = _read_turn(tty)
        if text is None or text.strip() in ("/exit", "/quit"):
            return
        if text.strip() == "/reset":
            chat.reset()
            if verbose or tty:
                log("(conversation reset)")
            continue
        if not text.strip():
            continue
        turn = chat.turn(text, max_tokens, params, stop)
        try:
            last, pieces, interrupted = _echo_records(turn, as_json)
        except KuiperError as e:
            if not tty:
                raise
            _err(_retag(str(e)))
            continue
        finally:
            turn.close()  # (an interrupted reply joins the conversation as far as it got)
        if chat.dropped:
            log(f"notice: dropped the oldest {chat.dropped} exchange{'s' * (chat.dropped > 1)} to fit the context "
                f"of {ctx} tokens ({ctx_flag})")
        if as_json and last is not None:
            click.echo(json.dumps({
                "text": "".join(pieces), "tokens": last.tokens,
                "finish_reason": "interrupted" if interrupted else last.finish_reason,
                "prompt_tokens": last.prompt_tokens, "cached_tokens": last.cached_tokens,
                "dropped_exchanges": chat.dropped, "seed": params.seed, "timings": _timings(last, chat)},
                ensure_ascii=False))
        elif not as_json:
            sys.stdout.write("\n")
            sys.stdout.flush()
        if last is not None:
            totals.add(last)
        if last is not None and last.finish_reason == "context" and not interrupted:
            log(f"notice: the reply stopped at the end of the context ({ctx} tokens; raise {ctx_flag})")
        if last is not None and verbose:
            reason, t = "interrupted" if interrupted else last.finish_reason, _timings(last)
            log(f"prompt {last.prompt_tokens} new tokens ({last.cached_tokens} cached), {t['prompt_tok_s']:.1f} tok/s | "
                f"generated {last.gen_tokens} tokens, {t['gen_tok_s']:.1f} tok/s | finish: {reason}"
                + (f" | {summary(chat.stats.as_dict())}" if chat.stats is not None else ""))
        if interrupted and not tty:
            sys.exit(130)


def _int_list(ctx, param, s: str) -> list[int]:
    """A comma-separated list of non-negative integers (click names the option in its message)."""
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{s!r} is not a comma-separated list of integers") from None
    if not out or any(v < 0 for v in out):
        raise click.BadParameter(f"{s!r} must list non-negative integers")
    return out


def _check_bench_sizes(n_prompt: list[int], n_gen: list[int], header, depths: list[int] = (0,)) -> None:
    """Each test against the model's context length (a tgN test at depth D asks for bench.tg_positions: max(D, 1) +
    N + 1 positions), before loading."""
    if header is None:
        return
    from .bench import tg_positions
    top = header.max_seq_len
    for p in n_prompt:
        if p > top:
            raise KuiperError(f"{_typed('-p', '--n-prompt')} {p} is over the model's context of {top} tokens")
    for n in n_gen:
        for d in depths:
            if tg_positions(n, d) > top:
                flags = _typed('-n', '--n-gen') + (f" {n} at {_typed('-d', '--n-depth')} {d}" if d else f" {n}")
                raise KuiperError(f"{flags} is over the model's context of {top} tokens (the test holds "
                                  f"{tg_positions(n, d)} positions)")


@_command("bench")
@click.option("-m", "--model", required=True, type=click.Path(), help="ak48 .bin file, Hugging Face directory or hub id.")
@click.option("-p", "--n-prompt", default="512", show_default=True, callback=_int_list,
              help="Prompt lengths (comma list); 0 skips.")
@click.option("-n", "--n-gen", default="128", show_default=True, callback=_int_list,
              help="Generated lengths (comma list); 0 skips.")
@click.option("-d", "--n-depth", "depths", default="0", show_default=True, callback=_int_list,
              help="Context depths (comma list): tg rows decode after a prompt of this many tokens, untimed "
                   "('tg128 @ d512'); pp rows are not affected.")
@click.option("-r", "--repetitions", type=int, default=5, show_default=True)
@click.option("-o", "--output", "out_fmt", type=click.Choice(["md", "json", "jsonl", "csv"]), default="md",
              show_default=True)
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("-t", "--threads", type=int, default=None, help="CPU threads of the CPU engine's BLAS.")
@_tp_option
@click.option("--batch", "batches", default=None, callback=lambda c, p, v: None if v is None else _int_list(c, p, v),
              help="Sequences run together (comma list, e.g. 1,16,64): rows 'tgN @ bB' of aggregate tok/s.")
def bench_cmd(model, n_prompt, n_gen, depths, repetitions, out_fmt, device, threads, tp, batches):
    """Prompt-processing (ppN) and text-generation (tgN) speed, like llama-bench. Each row is printed when its
    test finishes (Ctrl-C keeps the finished ones); a terminal sees each repetition's progress on stderr."""
    _set_threads(threads)
    if repetitions < 1:
        raise KuiperError(f"{_typed('-r', '--repetitions')} {repetitions} must be >= 1")
    model = _resolve(model)
    _check_bench_sizes(n_prompt, n_gen, _model_header(model), depths)
    if batches is not None and min(batches) < 1:
        raise KuiperError(f"--batch {','.join(map(str, batches))} must list sequence counts >= 1")
    if batches is not None and max(batches) > 1 and tp > 1:
        raise KuiperError(f"--batch above 1 and --tp {tp} cannot be combined yet")
    from .bench import batch_rows, bench_rows, load_engine, render_end, render_row
    eng = load_engine(model, n_prompt, n_gen, device, tp, depths)
    tty = sys.stderr.isatty()

    def progress(test: str, rep: int, of: int) -> None:
        if tty:
            sys.stderr.write(f"\r\033[K{test}: " + (f"repetition {rep}/{of}" if rep else "warm-up"))
            sys.stderr.flush()

    rows = bench_rows(eng, model, n_prompt, n_gen, repetitions, progress, depths) if batches is None else \
        batch_rows(eng, model, n_prompt, n_gen, batches, repetitions, progress, depths)

    done = 0
    try:
        for row in rows:
            if tty:
                sys.stderr.write("\r\033[K")
            click.echo(render_row(row, out_fmt, done), nl=out_fmt != "json")
            done += 1
    finally:  # (also on Ctrl-C: the rows printed so far stay a well-formed table or JSON document)
        if tty:
            sys.stderr.write("\r\033[K")
        end = render_end(out_fmt, done)
        if end is not None:
            click.echo(end)


from .serve.cli import serve  # noqa: E402 - (its FastAPI and uvicorn imports wait until the command runs)

cli.add_command(serve)
from . import cli_model  # noqa: E402,F401  (registers info and synth)

if __name__ == "__main__":
    main()
