"""The OpenAI-compatible surface as vLLM speaks it: request checks, output text, response bodies."""
from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
import zlib
from dataclasses import dataclass, field

from fleet.sim.prefix_cache import Image, Prompt

# A rough tokenizer: English averages about four characters a token; a token is 4 characters of text.
CHARS_PER_TOKEN = 4
# The chat template (ChatML, as MiniCPM-V's and Qwen's): each message is `<|im_start|>`, its role, a
# newline, its content, `<|im_end|>`; the generation prompt `<|im_start|>assistant\n` closes the prompt.
TOKENS_PER_MESSAGE = 4
GENERATION_PROMPT = ("<|im_start|>", "assistant", "\n")
IMAGE_TOKEN = "<image>"
# What one image costs in the prompt (a vision encoder's patch tokens at a modest resolution).
TOKENS_PER_IMAGE = 256

_DATA_IMAGE = re.compile(r"data:image/[\w.+-]+;base64,")
_FILLER = ("the quick model answers every question with calm and plausible words while the fleet "
           "keeps its engines busy and its queues short so that nobody waits longer than needed "
           "for a reply about weather tea trains clouds maps rivers and small brown foxes").split()
_ANSWER_WORD = re.compile("(?=" + "|".join(sorted(set(_FILLER), key=len, reverse=True)) + ")")


def sanitize_message(message: str) -> str:
    """What vLLM 0.32 leaves of an error message: no memory addresses, tracebacks or file paths
    (vllm/entrypoints/serve/exception_handling/utils.py, sanitize_message)."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


class ApiError(Exception):
    """A request refused with a vLLM-style error body."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def body(self) -> dict:
        # vLLM 0.32's ErrorResponse (vllm/entrypoints/serve/engine/protocol.py, ErrorInfo) as
        # create_error_response builds it (serve/exception_handling/error_response.py): message sanitized.
        return {"error": {"message": sanitize_message(self.message), "type": self.err_type,
                          "param": self.param, "code": self.status}}


def unknown_model(model, served_names: list[str]) -> ApiError:
    """The 404 for a `model` neither served nor an adapter (vllm/entrypoints/serve/engine/serving.py,
    _check_model: only the base names are listed as aliases)."""
    return ApiError(404, f"The model `{model}` does not exist. Valid aliases: {', '.join(served_names)}.",
                    "NotFoundError", "model")


def engine_dead_error() -> ApiError:
    """What vLLM answers once its EngineCore is gone."""
    return ApiError(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                    "InternalServerError")


@dataclass
class Job:
    """One generation request, reduced to what the timing and text model need."""

    kind: str  # "chat" or "completion"
    model: str
    prompt_tokens: int
    images: int
    max_tokens: int
    stream: bool
    include_usage: bool
    thinking: bool
    seed: int
    prompt: Prompt = field(default_factory=lambda: Prompt(()))
    continued: str = ""                # the text of the answer it continues (continue_final_message)
    cached_tokens: int | None = None   # the prompt's tokens found in the prefix cache, once scheduled
    details: bool = False              # --enable-prompt-tokens-details: usage says cached_tokens
    continuous_usage: bool = False     # stream_options.continuous_usage_stats: usage on every event


def output_cache_tokens(text: str) -> list[str]:
    """The answer's tokens as the next round's prompt has them (the chat template puts the answer's text
    as is): what the engine caches of its output, so a conversation's next round finds it."""
    return _text_tokens(text)


def _validation_error(kind: str, loc: str, message: str, value) -> ApiError:
    # The shape of pydantic's message, which is what vLLM puts in its 400 bodies.
    cls = "ChatCompletionRequest" if kind == "chat" else "CompletionRequest"
    return ApiError(400, f"1 validation error for {cls}\n{loc}\n  {message} "
                         f"[input_value={value!r}, input_type={type(value).__name__}]")


def _int_field(kind: str, body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _validation_error(kind, name, "Input should be a valid integer", value)
    if value < 1:
        raise ApiError(400, f"{name} must be at least 1, got {value}.", param=name)
    return value


def _text_tokens(text: str) -> list[str]:
    return [text[i:i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]


# How the sim's own answers are cut into tokens (output_tokens): a word with the space before it, the
# thinking block's markers; anything else a character a token.
_ANSWER_TOKEN = re.compile(r"<think>\n|\n</think>\n\n| ?[^ \n]+|[\s\S]")


_OWN_WORDS = frozenset(_FILLER) | {w + "." for w in _FILLER} | {"<think>\n", "\n</think>\n\n"}


def answer_tokens(text: str) -> list[str]:
    """text tokenized as the sim writes its answers: an answer continued (continue_final_message, or a
    completion's prompt ending with its own answer so far) counts as many tokens as were generated, as
    a real engine's tokenizer counts its own text (the same tokens, for most text)."""
    return _ANSWER_TOKEN.findall(text)


def _own_words(text: str) -> bool:
    """Whether text is made of the sim's answer words alone (its vocabulary has each as one token)."""
    return bool(text) and all(t.lstrip(" ") in _OWN_WORDS for t in answer_tokens(text))


def image_identifier(url: str) -> str:
    """An image's content hash: of a data URL's payload (whatever its declared type), else of its URL."""
    payload = url.split(",", 1)[1] if url.startswith("data:") else url
    return hashlib.sha256(payload.encode()).hexdigest()


def _chat_prompt(messages, generation_prompt: bool = True, continue_final: bool = False) -> tuple[list, list[Image], str]:
    """The chat template applied to the messages: tokens, images (placeholder tokens, hashed by
    content) and the messages' text. continue_final: the last message is left open (no `<|im_end|>`), as
    transformers' apply_chat_template does, its text the answer being continued (answer_tokens);
    generation_prompt: `<|im_start|>assistant\n` closes the prompt."""
    if not isinstance(messages, list) or not messages:
        raise _validation_error("chat", "messages", "Input should be a non-empty list", messages)
    tokens: list = []
    images: list[Image] = []
    texts: list[str] = []
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise _validation_error("chat", f"messages.{i}", "Input should be a message with a role", msg)
        content = msg.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        if not isinstance(parts, list):
            raise _validation_error("chat", f"messages.{i}.content", "Input should be a string or a list", content)
        tokens += ["<|im_start|>", msg["role"], "\n"]
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
                tokens += (answer_tokens if continue_final and i == last else _text_tokens)(part["text"])
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or (url.startswith("data:") and not _DATA_IMAGE.match(url)):
                    raise ApiError(400, "Invalid image_url: expected an http(s) URL or a "
                                        "data:image/...;base64,... URL.", param="messages")
                images.append(Image(image_identifier(url), len(tokens), TOKENS_PER_IMAGE))
                tokens += [IMAGE_TOKEN] * TOKENS_PER_IMAGE
            else:
                raise ApiError(400, f"Unsupported content part in messages.{i}: {part!r:.80}", param="messages")
        tokens.append("<|im_end|>")
    if continue_final:
        tokens.pop()
    if generation_prompt:
        tokens += GENERATION_PROMPT
    return tokens, images, "\n".join(texts)


def _completion_prompt(prompt) -> tuple[list, str]:
    """Tokens and text of a completion's prompt: a string, [string] or a list of token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _text_tokens(prompt) or [""], prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt), " ".join(map(str, prompt))
    raise ApiError(400, "prompt must be a string, a list of one string, or a list of token ids "
                        "(the sim serves one prompt per request).", param="prompt")


def parse(kind: str, body, served_names: list[str], max_model_len: int, adapters=()) -> Job:
    """Check a request body as vLLM would and reduce it to a Job; raises ApiError.

    adapters: the LoRA adapters' names. The job's model is the name answers carry: the adapter's for an
    adapter, else the first served name whichever served name was asked for, as vLLM 0.32 answers
    (OpenAIServingModels.model_name in vllm/entrypoints/openai/models/serving.py).
    """
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _validation_error(kind, "user", "Input should be a valid string", user)
    asked = _model_asked(kind, body, served_names, adapters)
    model = asked if asked in adapters else served_names[0]
    tokens, images, text, continued = _prompt(kind, body)
    if kind == "chat":
        max_tokens = _int_field(kind, body, "max_completion_tokens") or _int_field(kind, body, "max_tokens")
    else:
        max_tokens = _int_field(kind, body, "max_tokens")
    prompt_tokens = len(tokens)
    if prompt_tokens >= max_model_len or (max_tokens and prompt_tokens + max_tokens > max_model_len):
        asked = prompt_tokens + (max_tokens or 0)
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {asked} tokens ({prompt_tokens} in the messages, {max_tokens or 0} "
                            "in the completion). Please reduce the length of the messages or completion.")
    stream = bool(body.get("stream"))
    options = body.get("stream_options") or {}
    kwargs = body.get("chat_template_kwargs") or {}
    return Job(kind=kind, model=model, prompt_tokens=prompt_tokens, images=len(images),
               max_tokens=max_tokens or max_model_len - prompt_tokens, stream=stream,
               include_usage=stream and isinstance(options, dict) and bool(options.get("include_usage")),
               continuous_usage=stream and isinstance(options, dict) and bool(options.get("include_usage"))
               and bool(options.get("continuous_usage_stats")),
               thinking=isinstance(kwargs, dict) and bool(kwargs.get("enable_thinking")),
               seed=zlib.crc32(text.encode()),
               prompt=Prompt(tokens, images, model if model in adapters else None), continued=continued)


def _prompt(kind: str, body: dict) -> tuple[list, list[Image], str, str]:
    """The prompt's tokens, its images, its text without the answer it continues, and that answer's text
    ("" when it continues none)."""
    if kind == "chat":
        generation_prompt, continue_final = _template_flags(body)
        tokens, images, text = _chat_prompt(body.get("messages"), generation_prompt, continue_final)
        continued = ""
        if continue_final:
            continued, text = _continued(body["messages"], text)
        return tokens, images, text, continued
    tokens, text = _completion_prompt(body.get("prompt"))
    text, continued = _own_answer(text)
    if continued:
        tokens = (_text_tokens(text) or [""]) + answer_tokens(continued)
    return tokens, [], text, continued


def tokenize(body, served_names: list[str], max_model_len: int, adapters=()) -> dict:
    """vLLM's /tokenize: the prompt a chat (`messages`, the chat template's flags) or a completion
    (`prompt`) would have, counted (vllm/entrypoints/serve/tokenize/serving.py); a text made of the sim's
    own answer words alone, a token a word, as it wrote them (the proxy's count of an answer cut after
    it); raises ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    _model_asked("chat" if "messages" in body else "completion", body, served_names, adapters)
    prompt = body.get("prompt")
    if isinstance(prompt, str) and _own_words(prompt):
        tokens = answer_tokens(prompt)
    else:
        tokens = _prompt("chat" if "messages" in body else "completion", body)[0]
    return {"count": len(tokens), "max_model_len": max_model_len,
            "tokens": [zlib.crc32(str(t).encode()) & 0xFFFF for t in tokens], "token_strs": None}


def _model_asked(kind: str, body: dict, served_names: list[str], adapters) -> str | None:
    """The body's `model`, checked as vLLM checks it: a string, and a served name or an adapter's."""
    asked = body.get("model")
    if asked is not None and not isinstance(asked, str):
        raise _validation_error(kind, "model", "Input should be a valid string", asked)
    if asked and asked not in served_names and asked not in adapters:
        raise unknown_model(asked, served_names)
    return asked


def _template_flags(body: dict) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) as vLLM 0.32 reads them: both true is a 400
    (chat_completion/protocol.py, check_generation_prompt)."""
    generation_prompt, continue_final = body.get("add_generation_prompt", True), body.get("continue_final_message", False)
    for name, value in (("add_generation_prompt", generation_prompt), ("continue_final_message", continue_final)):
        if not isinstance(value, bool):
            raise _validation_error("chat", name, "Input should be a valid boolean", value)
    if continue_final and body.get("add_generation_prompt"):
        raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    return generation_prompt, continue_final


def _continued(messages: list, text: str) -> tuple[str, str]:
    """(the final message's text, the text of the messages before it): a model continues its own answer as
    if it had written it, so the sim seeds the answer with the conversation without it."""
    last = messages[-1].get("content")
    last = last if isinstance(last, str) else "".join(
        p.get("text", "") for p in last or [] if isinstance(p, dict) and p.get("type") == "text")
    before = text[:len(text) - len(last)]
    return last, before[:-1] if before.endswith("\n") else before


def output_tokens(job: Job, natural: int) -> tuple[list[str], str]:
    """The tokens the engine emits for a job and its finish_reason.

    natural: the answer's length without max_tokens; a thinking request's is three times as long,
    and opens with a <think> block of two thirds of it.
    """
    natural = max(1, natural)
    total = natural * 3 if job.thinking else natural
    words = _words(job.seed, total)
    if job.thinking:
        think = total - natural  # the block's tokens, its two markers included
        tokens = ["<think>\n", *_spaced(words[1:think - 1]), "\n</think>\n\n", *_spaced(words[think:], first="")]
    else:
        tokens = _spaced(words, first="")
    if job.continued:
        tokens = tokens[_written(tokens, job.continued):]
        total = len(tokens)
    if job.max_tokens < total:
        return tokens[:job.max_tokens], "length"
    return tokens, "stop"


def _words(seed: int, n: int) -> list[str]:
    """The first n words of the answer a seed gives (a full stop every twelfth)."""
    words = [_FILLER[(seed + i * 7) % len(_FILLER)] for i in range(n)]
    return [w + "." if i % 12 == 11 else w for i, w in enumerate(words)]


def _own_answer(prompt: str, look_back: int = 2048) -> tuple[str, str]:
    """(the prompt, "") or, when the prompt ends with the beginning of the answer its own start would get
    (a completion continued: the prompt plus the text so far), (that start, the text): a model continues
    its own text as it would have, so the answer goes on where the text stops. Each candidate start costs
    a running checksum; only one whose answer opens with the word found there is checked whole."""
    tail = prompt[-look_back:]
    at = len(prompt) - len(tail)
    seed = zlib.crc32(prompt[:at].encode())
    for m in _ANSWER_WORD.finditer(tail):     # where one of its words begins (the text may follow without a space)
        start = len(prompt) - len(tail) + m.start()
        seed, at = zlib.crc32(prompt[at:start].encode(), seed), start
        if not prompt.startswith(_FILLER[seed % len(_FILLER)], start):
            continue
        text = prompt[start:]
        if " ".join(_words(seed, len(text.split()))).startswith(text.rstrip()):
            return prompt[:start], text
    return prompt, ""


def _written(tokens: list[str], text: str) -> int:
    """How many of the answer's tokens text holds already: a greedy model continues its own text where it
    stopped (the text's length in tokens when it is not the answer's own beginning)."""
    at = 0
    for i, tok in enumerate(tokens):
        if not text.startswith(tok, at):
            return i if at == len(text) else max(i, len(text) // CHARS_PER_TOKEN)
        at += len(tok)
    return len(tokens)


def _spaced(words: list[str], first: str = " ") -> list[str]:
    return [(first if i == 0 else " ") + w for i, w in enumerate(words)]


def request_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(job: Job, completion_tokens: int) -> dict:
    """The usage object; with --enable-prompt-tokens-details also prompt_tokens_details.cached_tokens, as
    vLLM 0.32 adds it (chat_completion/serving.py, _make_prompt_tokens_details)."""
    out = {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": job.prompt_tokens + completion_tokens}
    if job.details and job.cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": job.cached_tokens}
    return out


def response_body(job: Job, rid: str, created: int, text: str, n_tokens: int, finish: str) -> dict:
    """The non-stream response."""
    if job.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                  "logprobs": None, "finish_reason": finish, "stop_reason": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": job.model, "choices": [choice],
            "usage": usage(job, n_tokens)}


def chunk(job: Job, rid: str, created: int, text: str | None, finish: str | None = None,
          role: bool = False, tokens: int = 0) -> bytes:
    """One SSE event of a stream; text None with finish None is the chat's opening role chunk. tokens: the
    answer's so far, this event's included (its usage with continuous_usage_stats, as vLLM 0.32 sends it;
    none otherwise: vLLM writes its events exclude_unset)."""
    if job.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": job.model, "choices": [choice]}
    if job.continuous_usage:
        body["usage"] = usage(job, tokens)
    return sse(body)


def usage_chunk(job: Job, rid: str, created: int, n_tokens: int) -> bytes:
    """The closing usage event of stream_options.include_usage."""
    obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    return sse({"id": rid, "object": obj, "created": created, "model": job.model, "choices": [],
                "usage": usage(job, n_tokens)})


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


DONE = b"data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
