"""The `kuiper` command line. stdout carries generated text or JSON only; everything else goes to stderr."""
from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
import traceback

import click

from .errors import KuiperError

DEBUG = {"on": False}


def _err(msg: str) -> None:
    click.echo(f"kuiper: error: {msg}", err=True)


def main(argv=None) -> None:
    """Entry point: one line and an exit code for every failure; a traceback only under --debug."""
    argv = list(sys.argv[1:] if argv is None else argv)
    DEBUG["on"] = "--debug" in argv or os.environ.get("KUIPER_DEBUG") == "1"
    if hasattr(signal, "SIGXFSZ"):  # a file-size limit should fail the write (EFBIG), not kill us
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        rc = cli.main(args=argv, prog_name="kuiper", standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except click.exceptions.Abort:
        click.echo("\nkuiper: interrupted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("\nkuiper: interrupted", err=True)
        sys.exit(130)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        _err(e.format_message())
        sys.exit(2)
    except KuiperError as e:
        if DEBUG["on"]:
            traceback.print_exc()
        _err(str(e))
        sys.exit(e.exit_code)
    except MemoryError:
        if DEBUG["on"]:
            traceback.print_exc()
        _err("out of host memory")
        sys.exit(3)
    except OSError as e:
        if DEBUG["on"]:
            traceback.print_exc()
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.ENOMEM):
            _err(f"out of resources: {e.strerror}")
            sys.exit(3)
        _err(f"{e.strerror or e}{': ' + str(e.filename) if e.filename else ''}")
        sys.exit(2)
    except BrokenPipeError:
        sys.stderr.close()
        sys.exit(0)
    except Exception as e:  # noqa: BLE001 - the last line of defence turns a bug into one line
        if DEBUG["on"]:
            traceback.print_exc()
        if type(e).__name__ == "OutOfMemoryError":  # cupy.cuda.memory.OutOfMemoryError
            _err(f"out of GPU memory: {e} (try a smaller --max-context)")
            sys.exit(3)
        _err(f"internal error: {type(e).__name__}: {e} (rerun with --debug for a traceback)")
        sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="kuiper", prog_name="kuiper")
def cli(debug: bool) -> None:
    """kuiper: Qwen3 AWQ inference from one ak48 file."""


@cli.command("export")
@click.argument("hf_dir", type=click.Path(file_okay=False, exists=True))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Output .bin file.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def export_cmd(hf_dir: str, output: str, quiet: bool) -> None:
    """Convert a Hugging Face Qwen3 AWQ checkpoint directory to an ak48 .bin file."""
    from .export import export
    export(hf_dir, output, progress=not quiet)


@cli.command("info")
@click.argument("model", type=click.Path())
@click.option("--verify", is_flag=True, help="Recompute and check the content checksum.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object to stdout.")
def info_cmd(model: str, verify: bool, as_json: bool) -> None:
    """Show an ak48 file's header, dimensions, sizes and checksum status."""
    from . import format as fmt
    from .loader import device_bytes, kv_bytes_per_position, load
    mf = load(model)
    h, a = mf.header, mf.args
    gpu, pinned = device_bytes(mf.weights)
    regions = fmt.regions(h)
    q_bytes = sum(r.nbytes for r in regions if r.name.split(".")[-1] in ("qweight", "qzeros", "scales"))
    status = "absent (plain v5 file)" if not (h.has_ext and h.flags & fmt.FLAG_CHECKSUM) else "present, not verified"
    ok = None
    if verify:
        ok = mf.verify_checksum()
        status = {None: "absent (plain v5 file)", True: "OK", False: "MISMATCH"}[ok]
    d = {"file": str(mf.path), "size": mf.size, "version": h.version, "kuiper_ext": h.has_ext,
         "model_type": a.model_type, "dim": h.dim, "intermediate": h.hidden_dim, "layers": h.n_layers,
         "heads": h.n_heads, "kv_heads": h.n_kv_heads, "head_dim": h.head_dim, "vocab": h.vocab_size,
         "max_seq_len": h.max_seq_len, "group_size": h.group_size, "shared_classifier": h.shared_classifier,
         "rope_theta": a.rope_theta, "rms_norm_eps": a.rms_norm_eps, "rope_scaling": a.rope_scaling,
         "bos_token_id": a.bos_token_id, "eos_token_ids": a.eos_token_ids, "n_params": fmt.n_params(h),
         "quantized_bytes": q_bytes, "tensors": len(regions), "weights_end": regions[-1].offset + regions[-1].nbytes,
         "trailer_bytes": h.trailer_length, "has_tokenizer": bool((mf.trailer or {}).get("tokenizer")),
         "checksum": status,
         # what --device cuda holds: the file's weights on the GPU, an untied embedding in pinned host memory,
         # and the fp16 KV cache per position of --max-context (workspace and MoE router rows come on top)
         "gpu_weight_bytes": gpu,
         "pinned_host_bytes": pinned, "kv_bytes_per_position": kv_bytes_per_position(a)}
    if h.is_moe:
        d.update(num_experts=h.num_experts, experts_per_tok=h.experts_per_tok, moe_intermediate=h.moe_intermediate,
                 norm_topk_prob=h.norm_topk_prob, decoder_sparse_step=h.decoder_sparse_step,
                 mlp_only_layers=list(h.mlp_only_layers))
    if as_json:
        click.echo(json.dumps(d))
    else:
        w = max(map(len, d)) + 1
        for k, v in d.items():
            click.echo(f"{k:{w}s} {v}")
    if ok is False:
        raise KuiperError("checksum mismatch: the file is damaged")


def _sampling_options(f):
    for opt in reversed([
        click.option("--temp", type=float, default=None, help="Temperature; 0 = greedy. Default: generation_config."),
        click.option("--top-k", type=int, default=None, help="Top-k (0 = off)."),
        click.option("--top-p", type=float, default=None, help="Top-p nucleus mass (1 = off)."),
        click.option("--min-p", type=float, default=None, help="Min-p relative to the top token (0 = off)."),
        click.option("--repeat-penalty", type=float, default=None, help="Repetition penalty (1 = off)."),
        click.option("--repeat-last-n", type=int, default=None, help="Tokens the repetition penalty looks back over."),
        click.option("--seed", type=int, default=None, help="Random seed for sampling."),
    ]):
        f = opt(f)
    return f


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


def _echo_records(records, as_json: bool) -> tuple:
    """Consume generate()'s records, each one's text streamed to stdout unless as_json: (the last record or None,
    the texts, whether Ctrl-C stopped it)."""
    last, pieces = None, []
    try:
        for r in records:
            last = r
            if r.text:
                pieces.append(r.text)
                if not as_json:
                    sys.stdout.write(r.text)
                    sys.stdout.flush()
    except KeyboardInterrupt:
        return last, pieces, True
    return last, pieces, False


def _timings(r) -> dict:
    """A generation's last record's prompt and generation figures, as the --json records give them."""
    return {"prompt_s": round(r.prompt_seconds, 4),
            "prompt_tok_s": round(r.prompt_tokens / max(r.prompt_seconds, 1e-9), 2),
            "generated_tokens": r.gen_tokens, "gen_s": round(r.gen_seconds, 4),
            "gen_tok_s": round(r.decode_steps / max(r.gen_seconds, 1e-9), 2)}


@cli.command("generate")
@click.option("-m", "--model", required=True, type=click.Path(), help="ak48 .bin file.")
@click.option("-p", "--prompt", default=None, help="Prompt text, or - to read stdin.")
@click.option("-f", "--file", "prompt_file", default=None, type=click.Path(), help="Read the prompt from a file.")
@click.option("-n", "--max-tokens", type=int, default=256, show_default=True, help="Tokens to generate at most.")
@_sampling_options
@click.option("--stop", multiple=True, help="Stop when this text is generated (repeatable).")
@click.option("--raw", is_flag=True, help="Feed the prompt as is, without the chat template.")
@click.option("--think/--no-think", default=None, help="Qwen3 thinking mode (enable_thinking); default: the template's.")
@click.option("-s", "--system", default=None, help="System message for the chat template.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--max-context", type=int, default=None, help="KV cache positions (default: prompt + max tokens).")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(), default=None,
              help="Hugging Face directory with tokenizer.json (for plain v5 files).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON record instead of streaming text.")
@click.option("-v", "--verbose", is_flag=True, help="More logs on stderr.")
def generate_cmd(model, prompt, prompt_file, max_tokens, temp, top_k, top_p, min_p, repeat_penalty,
                 repeat_last_n, seed, stop, raw, think, system, device, max_context, tokenizer_dir, as_json, verbose):
    """Generate text from a prompt, streaming it to stdout."""
    from .generate import Engine, generate, log
    from .sampling import SamplingParams

    text = _read_prompt(prompt, prompt_file)
    eng = Engine.load(model, device, tokenizer_dir)
    tok = eng.tokenizer
    params = SamplingParams.from_generation_config(
        (eng.file.trailer or {}).get("generation_config"), temperature=temp, top_k=top_k, top_p=top_p,
        min_p=min_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed)
    if raw:
        if system is not None or think is not None:
            raise KuiperError("--system and --think/--no-think need the chat template; drop --raw")
        prompt_text = text
    else:
        msgs = ([{"role": "system", "content": system}] if system is not None else []) + \
               [{"role": "user", "content": text}]
        prompt_text = tok.apply_chat_template(msgs, enable_thinking=think)
    ids = tok.encode(prompt_text)
    if verbose:
        a = eng.file.args
        moe = f", {a.num_experts} experts, {a.num_experts_per_tok} per token" if a.num_experts else ""
        log(f"model: {eng.file.path} ({a.num_hidden_layers} layers, dim {a.hidden_size}{moe}), device {eng.device}")
        log(f"sampling: {params}")
        log(f"prompt: {len(ids)} tokens")
    if max_context is not None and max_context <= 0:
        raise KuiperError(f"--max-context {max_context} must be positive")
    last, pieces, interrupted = _echo_records(generate(eng, ids, max_tokens, params, list(stop), max_context), as_json)
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
        log(f"notice: generation stopped at the context limit ({eng.model.max_context} positions; raise --max-context)")
    stats = {"load_s": round(eng.load_seconds, 3), "warmup_s": round(last.warmup_seconds, 3),
             "prompt_tokens": last.prompt_tokens, **_timings(last), "peak_host_mib": round(_peak_host_mib(), 1)}
    if eng.device == "cuda":
        from .ops_cupy import gpu_memory_used_mib, kernel_build_seconds
        stats["gpu_mib"] = round(gpu_memory_used_mib(), 1)
        # waited for in the load, the warm-up and the prompt: large on a machine's first run (NVRTC), ~0.1 s after
        stats["kernel_build_s"] = round(kernel_build_seconds(), 3)
    if as_json:
        click.echo(json.dumps({"text": "".join(pieces), "tokens": last.tokens, "finish_reason": reason,
                               "prompt_tokens": last.prompt_tokens, "timings": stats}, ensure_ascii=False))
    build = stats.get("kernel_build_s", 0.0)
    log(f"load {stats['load_s']:.2f} s | " + (f"warm-up {stats['warmup_s']:.2f} s | " if stats["warmup_s"] else "")
        + f"prompt {stats['prompt_tokens']} tokens, {stats['prompt_tok_s']:.1f} tok/s | "
        f"generated {stats['generated_tokens']} tokens, {stats['gen_tok_s']:.1f} tok/s | finish: {reason} | "
        f"peak host {stats['peak_host_mib']:.0f} MiB" + (f" | GPU {stats['gpu_mib']:.0f} MiB" if "gpu_mib" in stats else "")
        + (f" | {build:.1f} s waiting for kernel builds (a first run compiles them; later runs load CuPy's disk cache)"
           if build >= 1.0 else ""))
    if interrupted:
        sys.exit(130)


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


@cli.command("chat")
@click.option("-m", "--model", required=True, type=click.Path(), help="ak48 .bin file.")
@click.option("-n", "--max-tokens", type=int, default=1024, show_default=True, help="Tokens per reply at most.")
@_sampling_options
@click.option("--stop", multiple=True, help="End a reply when this text is generated (repeatable).")
@click.option("--think/--no-think", default=None, help="Qwen3 thinking mode (enable_thinking); default: the template's.")
@click.option("-s", "--system", default=None, help="System message, kept for the whole chat.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--max-context", type=int, default=None,
              help=f"KV cache positions for the whole conversation (default {CHAT_CONTEXT}, or the model's maximum).")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(), default=None,
              help="Hugging Face directory with tokenizer.json (for plain v5 files).")
@click.option("--json", "as_json", is_flag=True, help="One JSON line per reply instead of streaming text.")
@click.option("-v", "--verbose", is_flag=True, help="A line of statistics per reply on stderr.")
def chat_cmd(model, max_tokens, temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed, stop, think, system,
             device, max_context, tokenizer_dir, as_json, verbose):
    """Chat on one KV cache: each line of stdin is a user message (a line ending in a backslash continues on
    the next), and each turn prefills only the tokens the cache does not already hold. /reset starts over;
    /exit or the end of input quits. Replies go to stdout, everything else to stderr."""
    from .generate import Chat, Engine, log
    from .sampling import SamplingParams

    if max_tokens < 1:
        raise KuiperError(f"--max-tokens {max_tokens} must be >= 1")
    if max_context is not None and max_context <= 0:
        raise KuiperError(f"--max-context {max_context} must be positive")
    eng = Engine.load(model, device, tokenizer_dir)
    params = SamplingParams.from_generation_config(
        (eng.file.trailer or {}).get("generation_config"), temperature=temp, top_k=top_k, top_p=top_p,
        min_p=min_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed)
    ctx = max_context or min(CHAT_CONTEXT, eng.file.args.max_position_embeddings)
    eng.tokenizer.apply_chat_template([{"role": "user", "content": ""}])  # (no chat template: the error comes now)
    t0 = time.perf_counter()
    chat = Chat(eng, ctx, system, think)
    if verbose and chat.warmed:
        log(f"captured the prefill graphs of {len(chat.warmed)} prompt lengths up to {max(chat.warmed)} tokens in "
            f"{time.perf_counter() - t0:.2f} s")
    tty = sys.stdin.isatty()
    if tty:
        log(f"kuiper chat: {eng.device}, context {ctx} tokens; /reset starts over, /exit quits, "
            f"a line ending in \\ continues")
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
        turn = chat.turn(text, max_tokens, params, list(stop))
        try:
            last, pieces, interrupted = _echo_records(turn, as_json)
        except KuiperError as e:
            if not tty:
                raise
            _err(str(e))
            continue
        finally:
            turn.close()  # (an interrupted reply joins the conversation as far as it got)
        if chat.dropped:
            log(f"notice: dropped the oldest {chat.dropped} exchange{'s' * (chat.dropped > 1)} to fit the context "
                f"of {ctx} tokens (--max-context)")
        if as_json and last is not None:
            click.echo(json.dumps({
                "text": "".join(pieces), "tokens": last.tokens,
                "finish_reason": "interrupted" if interrupted else last.finish_reason,
                "prompt_tokens": last.prompt_tokens, "cached_tokens": last.cached_tokens,
                "dropped_exchanges": chat.dropped, "timings": _timings(last)}, ensure_ascii=False))
        elif not as_json:
            sys.stdout.write("\n")
            sys.stdout.flush()
        if last is not None and last.finish_reason == "context" and not interrupted:
            log(f"notice: the reply stopped at the end of the context ({ctx} tokens; raise --max-context)")
        if last is not None and verbose:
            reason, t = "interrupted" if interrupted else last.finish_reason, _timings(last)
            log(f"prompt {last.prompt_tokens} new tokens ({last.cached_tokens} cached), {t['prompt_tok_s']:.1f} tok/s | "
                f"generated {last.gen_tokens} tokens, {t['gen_tok_s']:.1f} tok/s | finish: {reason}")
        if interrupted and not tty:
            sys.exit(130)


def _int_list(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{s!r} is not a comma-separated list of integers") from None
    if not out or any(v < 0 for v in out):
        raise click.BadParameter(f"{s!r} must list non-negative integers")
    return out


@cli.command("bench")
@click.option("-m", "--model", required=True, type=click.Path(), help="ak48 .bin file.")
@click.option("-p", "--n-prompt", default="512", show_default=True, help="Prompt lengths (comma list); 0 skips.")
@click.option("-n", "--n-gen", default="128", show_default=True, help="Generated lengths (comma list); 0 skips.")
@click.option("-r", "--repetitions", type=int, default=5, show_default=True)
@click.option("-o", "--output", "out_fmt", type=click.Choice(["md", "json", "csv"]), default="md", show_default=True)
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
def bench_cmd(model, n_prompt, n_gen, repetitions, out_fmt, device):
    """Prompt-processing (ppN) and text-generation (tgN) speed, like llama-bench."""
    from .bench import run_bench, render
    if repetitions < 1:
        raise KuiperError(f"-r {repetitions} must be >= 1")
    rows = run_bench(model, _int_list(n_prompt), _int_list(n_gen), repetitions, device)
    click.echo(render(rows, out_fmt))


from .serve.cli import serve  # noqa: E402 - (its FastAPI and uvicorn imports wait until the command runs)

cli.add_command(serve)

if __name__ == "__main__":
    main()
