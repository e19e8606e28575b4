"""
What a request to the OpenAI-compatible API (nanochat/openai_api.py) may hold, checked before anything is
generated: each function returns what the endpoint needs, or raises APIError 400 whose message starts with the
field at fault ("messages[2].role: ..."), as nanochat's own endpoint does. Checks the limits first (cheap) and
tokenizes last: tokenizing is the only work a bad request can cause.
"""

import json
import logging
import random

from fastapi.responses import JSONResponse

logger = logging.getLogger("nanochat.openai_api")
MAX_STOPS, MAX_STOP_CHARS = 16, 100  # stop strings a request may give, and their length (checked at every token)
MAX_LOGPROBS = 20  # most likely tokens listed per position (OpenAI allows 5)
MAX_PROMPTS = 64  # prompts one /v1/completions request may hold (they are answered one after the other)
# fields read by the endpoints, and those that change nothing here: neither is logged as ignored
KNOWN_FIELDS = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_k", "seed",
                "stop", "stream", "stream_options", "echo", "logprobs", "user", "metadata", "store", "service_tier",
                "parallel_tool_calls"}
_logged_fields = set()  # ignored fields already named in the log


# -----------------------------------------------------------------------------
# Errors


class APIError(Exception):
    """An answer in OpenAI's error shape; raised anywhere in a request, sent by mount()'s handler."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self):
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(status_code=self.status, content=body, headers=headers)


def bad(param, problem, code=None):
    """400 for field `param`; the message starts with the field's name, as nanochat's own endpoint does."""
    return APIError(400, f"{param}: {problem}", param=param, code=code)


# -----------------------------------------------------------------------------
# Reading a request


KINDS = {"int": ((int,), "an integer"), "number": ((int, float), "a number"), "bool": ((bool,), "true or false"),
         "str": ((str,), "a string"), "list": ((list,), "a list"), "dict": ((dict,), "an object")}


def get(body, name, kind, default=None):
    """body[name], checked to be of `kind` (see KINDS; a bool is not a number); null or absent gives `default`."""
    value = body.get(name)
    if value is None:
        return default
    types, description = KINDS[kind]
    if not isinstance(value, types) or (isinstance(value, bool) and kind != "bool"):
        raise bad(name, f"must be {description}, got {json.dumps(value)[:60]}")
    return value


async def read_body(request, settings):
    """The request's JSON object; 400 if it is not one, 404 if it names another model."""
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep for the parser
        raise bad("body", f"not valid JSON ({type(e).__name__}: {e})"[:300]) from None
    if not isinstance(body, dict):
        raise bad("body", 'must be a JSON object, like {"model": "...", "messages": [...]}')
    model = get(body, "model", "str", settings.model_name)
    if model != settings.model_name:
        raise APIError(404, f"the model {model!r} does not exist: this server serves {settings.model_name!r} "
                            f"(GET /v1/models)", param="model", code="model_not_found")
    return body


REFUSED = {  # field: why it cannot be honoured. Accepted only where it asks for nothing (no_op), n and best_of at 1
    "n": "nanochat returns one choice per request: leave n out or set it to 1",
    "best_of": "nanochat returns one choice per request: leave best_of out or set it to 1",
    "presence_penalty": "repetition penalties are not supported: leave it out or set it to 0",
    "frequency_penalty": "repetition penalties are not supported: leave it out or set it to 0",
    "logit_bias": "logit_bias is not supported",
    "tools": "tools are not supported (nanochat's only tool is its built-in calculator)",
    "tool_choice": "tools are not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "response_format": "only text replies are supported",
    "top_logprobs": "log-probabilities come from /v1/completions (logprobs), not from chat",
    "suffix": "inserting text (suffix) is not supported",
}


def no_op(name, value):
    """Whether a refused field's value asks for nothing, so that it can be accepted."""
    if name in ("n", "best_of"):
        return value is None or (type(value) is int and value == 1)
    return value in (None, False, 0, "", [], {}, "none", {"type": "text"})


def check_sampling(body, settings, pool, min_tokens, tokens_field):
    """
    The sampling settings shared by both endpoints, checked: a dict of Engine.generate's arguments (temperature,
    top_k, max_tokens, seed; max_tokens from the field `tokens_field`, at least `min_tokens`) and the stop strings.
    """
    for name, why in REFUSED.items():
        if not no_op(name, body.get(name)):
            raise bad(name, why)
    unknown = set(body) - KNOWN_FIELDS - set(REFUSED) - {"top_p"} - _logged_fields
    if unknown:
        logger.warning(f"OpenAI API: ignored the request field(s) {sorted(unknown)} (named once)")
        _logged_fields.update(unknown)
    temperature = get(body, "temperature", "number", settings.temperature)
    if not 0 <= temperature <= 2:  # written this way round so that NaN fails too
        raise bad("temperature", f"must be between 0 and 2 (0 = greedy), got {temperature}")
    top_p = get(body, "top_p", "number", 1)
    if not 0 < top_p <= 1:
        raise bad("top_p", f"must be between 0 and 1, got {top_p}")
    if top_p != 1:
        raise bad("top_p", "nanochat samples with temperature and top_k only (no nucleus sampling): leave top_p "
                           "out or set it to 1, and limit sampling with top_k (extra_body={'top_k': 50})")
    top_k = get(body, "top_k", "int", min(settings.top_k, pool.vocab_size))
    if not -1 <= top_k <= pool.vocab_size:
        raise bad("top_k", f"must be between 0 and {pool.vocab_size} (the vocabulary; 0 or -1 = all of it), got {top_k}")
    max_tokens = get(body, tokens_field, "int", settings.max_tokens)
    if not min_tokens <= max_tokens <= settings.max_tokens_limit:
        raise bad(tokens_field, f"must be between {min_tokens} and {settings.max_tokens_limit}, got {max_tokens}")
    seed = get(body, "seed", "int")
    if seed is not None and not 0 <= seed < 2**63:
        raise bad("seed", f"must be between 0 and 2**63 - 1, got {seed}")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list):
        raise bad("stop", "must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"{len(stops)} strings, at most {MAX_STOPS} are accepted")
    for i, s in enumerate(stops):
        if not isinstance(s, str) or len(s) > MAX_STOP_CHARS:
            raise bad(f"stop[{i}]", f"must be a string of at most {MAX_STOP_CHARS} characters")
    sampling = dict(temperature=float(temperature), top_k=max(top_k, 0), max_tokens=max_tokens,
                    seed=random.randrange(2**31) if seed is None else seed)  # a fresh seed per request by default
    return sampling, [s for s in stops if s]  # an empty stop string would end every reply at once: it is ignored


def chat_prompt(body, settings, pool):
    """The prompt tokens of a chat request, rendered as nanochat renders conversations."""
    messages = get(body, "messages", "list")
    if not messages:
        raise bad("messages", "missing or empty: send at least one user message")
    if len(messages) > settings.max_messages:
        raise bad("messages", f"{len(messages)} messages, at most {settings.max_messages} are accepted")
    conversation, total = [], 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, 'must be an object like {"role": "user", "content": "Hi"}')
        role = message.get("role")
        role = "system" if role == "developer" else role  # OpenAI's newer name for the system message
        if role not in ("system", "user", "assistant"):
            raise bad(f"{where}.role", f"{role!r} is not supported: use system, user or assistant")
        if message.get("tool_calls") or message.get("function_call"):
            raise bad(f"{where}.tool_calls", "tools are not supported")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content[{j}]", 'only text parts are supported: {"type": "text", "text": "..."}')
            content = "\n".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content", "must be a string or a list of text parts")
        if len(content) > settings.max_message_chars:
            raise bad(f"{where}.content", f"{len(content):,} characters, at most {settings.max_message_chars:,} are accepted")
        total += len(content)
        conversation.append({"role": role, "content": content})
    first = 1 if conversation[0]["role"] == "system" else 0
    for i in range(first, len(conversation)):
        expected = "user" if (i - first) % 2 == 0 else "assistant"
        if conversation[i]["role"] != expected:
            raise bad(f"messages[{i}].role", f"is {conversation[i]['role']!r}, expected {expected!r}: after an optional "
                                             f"first system message, roles alternate user/assistant, starting with user")
    if conversation[-1]["role"] != "user":
        raise bad(f"messages[{len(messages) - 1}].role", "the conversation must end with a user message (the one to reply to)")
    if total > settings.max_conversation_chars:
        raise bad("messages", f"the conversation is {total:,} characters, at most {settings.max_conversation_chars:,} are accepted")
    prompt = pool.tokenizer.render_for_completion({"messages": conversation})
    if len(prompt) >= pool.context_len:
        raise bad("messages", f"the conversation is {len(prompt):,} tokens and the model's context holds {pool.context_len:,} "
                              f"(with room for the reply): send fewer or shorter messages", code="context_length_exceeded")
    return prompt


def completion_prompts(body, settings, pool):
    """
    The prompts of a completions request (a string, a list of strings, a list of token ids, or a list of such
    lists) as the model reads them: a list of (tokens, added), where `added` is 1 if the server put the <|bos|>
    that tokens starts with in front of what was sent, 0 if the prompt started with it (see openai_api's docstring).
    """
    prompt = body.get("prompt")
    single = isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int))
    if single:
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad("prompt", "missing or empty: send a string, a list of token ids, or a list of either")
    if len(prompt) > MAX_PROMPTS:
        raise bad("prompt", f"{len(prompt)} prompts, at most {MAX_PROMPTS} are accepted")
    bos = pool.tokenizer.get_bos_token_id()
    prompts = []
    for i, p in enumerate(prompt):
        where = "prompt" if single else f"prompt[{i}]"
        if isinstance(p, str):
            if len(p) > settings.max_conversation_chars:
                raise bad(where, f"{len(p):,} characters, at most {settings.max_conversation_chars:,} are accepted")
            p = pool.tokenizer.encode(p)
        elif not isinstance(p, list) or not p:
            raise bad(where, "must be a string or a non-empty list of token ids")
        elif not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < pool.vocab_size for t in p):
            raise bad(where, f"token ids must be integers in [0, {pool.vocab_size}) (the model's vocabulary)")
        added = int(not p or p[0] != bos)
        p = [bos] * added + p
        if len(p) > pool.context_len:
            raise bad(where, f"{len(p):,} tokens as the model reads it (<|bos|> first), and the model's context holds "
                             f"{pool.context_len:,}", code="context_length_exceeded")
        prompts.append((p, added))
    return prompts
