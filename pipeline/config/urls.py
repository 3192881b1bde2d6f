"""Secrets in a URL (a served reward's, a data file's, a Ray cluster's): sent, never stored.

A URL's secret parts (a query parameter's value such as `?key=...`, a password in `user:pass@`,
or any other part) are written as references to environment variables, `${NAME}`:

    url: https://rm.example.com/get_reward?key=${RM_URL_KEY}

The config (the user's file, the run's config.yaml, its hash), every record (a served answer's
`server`, the judge cache), MLflow and every message keep the reference; the value is read from
the environment of each process that sends a request (`expand`), as `api_key_env`'s key is, so a
resumed stage and a Ray node need the variable set too, and a rotated key changes nothing of the
run (the config hash covers the variable's name, not its value). Any part of a URL may be a
reference (a key in its path too); a secret written literally is refused when a config is read
from the user (`literal_secret`): a query parameter whose name says it is one (`key`, `token`,
`sig`, `code`, `api_key`, `access_token`, `password`, `secret`, ... case-insensitive,
`is_secret_param`), a user or password in the userinfo, and a fragment (never sent by any HTTP
client, so only ever stored). A run's stored config.yaml written before this rule is read as it
was (its literal is sent, and stored, as before).

Values expanded in this process are remembered, and `mask` replaces each with `***` in any text
(an HTTP library's error, a server's error message that quotes the URL it was sent), and a
logging filter does the same for httpx's own request lines.
"""

from __future__ import annotations

import json
import logging
import os
import re
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

from pipeline.errors import GRPOError

REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""A reference to an environment variable: `${NAME}`."""
SECRET_ENDINGS = ("key", "keys", "token", "tokens", "secret", "secrets", "password", "passwd", "passcode", "passphrase",
                  "signature", "credential", "credentials", "authorization")
SECRET_WORDS = ("sig", "code", "pwd", "pass", "auth", "jwt", "bearer", "hmac")
"""A query parameter is a secret (case-insensitive) when one of its words (split at `_`, `-`, `.`) ends in one of
SECRET_ENDINGS or is one of SECRET_WORDS: key, apikey, api_key, X-Api-Key, subscription-key, token, access_token,
client_secret, password, X-Amz-Signature, sig (an Azure SAS), code (an Azure Functions key)."""
MASK = "***"
SHORT = 4
"""A secret of fewer characters is masked only where it stands alone (not inside a longer word or number):
"Bearer ab" hides "ab", "table" keeps its "ab"."""
_KNOWN: set[str] = set()
"""The values `expand` read in this process: `mask` hides them."""
_NAMED: set[str] = set()
"""The config's `url_secret_params` (lower-cased): parameter names the user says hold a secret."""


def is_secret_param(name: str, named=()) -> bool:
    """Whether a URL parameter called `name` holds a secret: its words say so (SECRET_ENDINGS, SECRET_WORDS), or
    the user named it (`url_secret_params`, this process's config; `named`: a config's being read)."""
    if name.lower() in _NAMED or name.lower() in {n.lower() for n in named}:
        return True
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    return any(w.endswith(SECRET_ENDINGS) or w in SECRET_WORDS for w in words)


def name_secret_params(names) -> None:
    """The config's `url_secret_params`, for `redacted` in this process (a URL taken from the environment)."""
    _NAMED.update(n.lower() for n in names)


def _params(query: str) -> list[tuple[str, str]]:
    """A query's (name, value) pairs, split at `&` and at `;` (which some servers take as a separator too)."""
    return [pair for part in query.split(";") for pair in parse_qsl(part, keep_blank_values=True)]


def _path_params(path: str) -> list[tuple[str, str]]:
    """A path's parameters (`/get_reward;key=...`, RFC 3986's `;name=value` in a segment) as (name, value) pairs."""
    return [pair for seg in path.split("/") for part in seg.split(";")[1:] for pair in parse_qsl(part, keep_blank_values=True)]


def names(url: str) -> list[str]:
    """The environment variables `url` references, in order, each once."""
    return list(dict.fromkeys(REF.findall(url or "")))


def literal_secret(url: str, named=()) -> str | None:
    """Why `url` cannot be kept as written (a secret written into it, a fragment, a broken `${`), or None.
    `named`: parameter names the config says hold a secret (`url_secret_params`)."""
    if "${" in REF.sub("", url):
        return "holds a `${` that is no reference ${NAME} (letters, digits, _)"
    if REF.search(unquote(REF.sub("", url))):
        return "holds a percent-encoded ${NAME} (%24%7B...%7D), which would be sent as written: write ${NAME} as it is"
    if "#" in url:
        return "holds a fragment (#...), which is never sent to a server, only stored: remove it"
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return None  # not a URL: its own validator says so
    for part, what in ((parts.username, "a user"), (password, "a password")):
        if part is not None and not REF.fullmatch(part):
            return (f"holds {what} (user:password@), which would be stored with the run and every answer: write it as "
                    "${NAME} and set NAME in the environment")
    for where, name, value in [("query ", *p) for p in _params(parts.query)] + [("path ", *p) for p in _path_params(parts.path)]:
        if is_secret_param(name, named) and value and not REF.fullmatch(value):
            return (f"its {where}parameter {name!r} holds a secret, which would be stored with the run and every answer: "
                    f"write {name}=${{NAME}} and set NAME in the environment (its name is stored, its value read where "
                    "each request is sent)")
    return None


def expand(url: str, where: str) -> str:
    """`url` with every `${NAME}` replaced by the variable's value (percent-encoded but for `%`, so a value
    already encoded is sent as it is); one-line GRPOError naming `where` (the option) when one is unset."""
    def value(m: re.Match) -> str:
        name = m.group(1)
        got = os.environ.get(name)
        if not got:
            raise GRPOError(f"{where}: the environment variable {name} is not set (the URL's ${{{name}}}: its value is "
                            "never stored, so every process that sends a request reads it)")
        remember(got)
        return quote(got, safe="%-._~")

    return REF.sub(value, url)


def checked(url: str, context, fix: str | None = None) -> str:
    """A validator's check of a URL option: refused (ValueError) when a secret is written into it, unless
    the config is a run's stored one (`context` {"stored": True}: written before the rule, read as it was).
    `fix`: what to do instead, where a `${NAME}` reference is not read (the option is not a served reward's)."""
    if not (isinstance(context, dict) and context.get("stored")):
        why = literal_secret(url, context.get("secret_params", ()) if isinstance(context, dict) else ())
        if why is not None:
            raise ValueError(why if fix is None else f"{why.split(', which ')[0].split(': ')[0]}, which would be stored "
                                                     f"with the run: {fix}")
    return url


LOCATION_FIX = "write it as ${NAME} and set NAME in the environment (read where it is used, never stored)"
"""`checked`'s fix for a location that is no served reward's (a data URL, a Ray address): `${NAME}` is
expanded where it is read (pipeline/data/sources.py, pipeline/cluster/executor.py: connect)."""


def checked_location(value: str, context) -> str:
    """`checked` for a location that may be a local path (data.train, data.eval, cluster.address): only a value
    with a scheme (`https://`, `s3://`, `ray://`) is a URL whose parts can hold a secret."""
    return checked(value, context, LOCATION_FIX) if "://" in value else value


def redacted(url: str) -> str:
    """`url` with its userinfo's password and every secret query parameter's value (`is_secret_param`)
    as `***`: a URL taken from the environment (MLFLOW_TRACKING_URI) as a record may keep it."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return url
    hidden = lambda v: bool(v) and not REF.fullmatch(v)  # noqa: E731 (a ${NAME} reference is no secret: kept)
    user, _, host = parts.netloc.rpartition("@")
    secret_param = lambda k, v: is_secret_param(unquote(k)) and hidden(v)  # noqa: E731
    pairs = [p.partition("=") for p in re.split(r"[&;]", parts.query)]
    segs = [[p.partition("=") for p in seg.split(";")] for seg in parts.path.split("/")]  # a segment's ;name=value too
    in_path = any(secret_param(k, v) for seg in segs for k, _, v in seg[1:])
    if not hidden(user) and not parts.fragment and not in_path and not any(secret_param(k, v) for k, _, v in pairs):
        return url  # nothing to hide: the URL as given, byte for byte
    path = "/".join(";".join([seg[0][0], *(f"{k}={MASK}" if secret_param(k, v) else "".join((k, sep, v)) for k, sep, v in seg[1:])])
                    for seg in segs)
    if hidden(password):
        user = f"{user.split(':')[0]}:{MASK}"
    elif hidden(user) and password is None:  # a user alone may be the token itself (https://TOKEN@host): MLflow drops
        user = MASK                          # a git URL's userinfo whole
    netloc = f"{user}@{host}" if user else host
    query = "&".join(f"{k}={MASK}" if secret_param(k, v) else (f"{k}={v}" if sep else k) for k, sep, v in pairs if k or sep)
    return urlunsplit(parts._replace(netloc=netloc, path=path, query=query, fragment=MASK if parts.fragment else ""))


def remember(value: str) -> None:
    """`value` is a secret sent from this process (a URL's, a Bearer key): `mask` hides it from here on
    (one of fewer than SHORT characters where it stands alone)."""
    if value.strip() and value not in _KNOWN:
        _KNOWN.update(v for v in _forms(value) if v.strip())
        _install_filter()


def _forms(value: str) -> set[str]:
    """The ways a text may quote `value`: as sent (percent-encoded), decoded (a server echoing a value given
    already encoded), stripped (a key read with a trailing newline), and as Python's and JSON's reprs
    write it (httpx's "Illegal header value b'Bearer ...\\n'")."""
    out = {value, quote(value, safe="%-._~"), unquote(value), value.strip()}
    out |= {repr(v)[1:-1] for v in list(out)} | {repr(v.encode())[2:-1] for v in list(out)}
    out |= {json.dumps(v)[1:-1] for v in list(out)}
    return out


URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()]+")


def scrub(text: str) -> str:
    """`text` (another library's error: MLflow's quotes the tracking URI it could not reach, password and
    all) with every URL in it `redacted` and every value expanded here `mask`ed."""
    def one(m: re.Match) -> str:
        url = m.group(0).rstrip(".,;:!?")  # a sentence's punctuation after the URL is not part of it
        return redacted(url) + m.group(0)[len(url):]

    return mask(URL_IN_TEXT.sub(one, text))


def mask(text: str) -> str:
    """`text` with every secret value expanded in this process replaced by `***`."""
    return hide(text, _KNOWN)


_ALONE = r"(?:(?<![A-Za-z0-9])|(?<=%[0-9A-Fa-f]{2})|(?<=\\[nrt])|(?<=\\u[0-9A-Fa-f]{4}))"
"""Where a short secret stands alone: no letter or digit before it, but for an escape's (`%3D` of a URL quoted
percent-encoded, `\\n` of a repr, `\\u0026` of JSON)."""


def hide(text: str, values) -> str:
    """`text` with each of `values` replaced by `***`, longest first; one of fewer than SHORT characters
    only where no letter or digit touches it (a 3-character key inside every word it spells would be no mask)."""
    for value in sorted(values, key=len, reverse=True):
        if len(value) >= SHORT:
            text = text.replace(value, MASK)
        elif value in text:
            text = re.sub(rf"{_ALONE}{re.escape(value)}(?![A-Za-z0-9])", MASK, text)
    return text


def mask_json(data):
    """Parsed JSON (a server's answer, stored whole) with every string in it masked: a server that
    echoes the URL or key it was sent in a 200 answer does not put the key in the records. Numbers
    are left as they are, so the reward read from the answer is the same. Only values of SHORT
    characters or more: a judge's verdict is read from the masked answer, and a 1-character value
    (`expand` remembers every `${NAME}`, a port's too) would turn "Score: 1" into "Score: ***"; a key
    under SHORT characters that a server echoes in a 200 answer is therefore stored (docs/rewards.md)."""
    long = {v for v in _KNOWN if len(v) >= SHORT}
    if not long:
        return data
    if isinstance(data, str):
        return hide(data, long)
    if isinstance(data, list):
        return [mask_json(v) for v in data]
    if isinstance(data, dict):
        return {hide(k, long) if isinstance(k, str) else k: mask_json(v) for k, v in data.items()}
    return data


class _Masking(logging.Filter):
    """Masks expanded secrets in an HTTP library's log records (httpx logs every request's URL at INFO)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _KNOWN:
            said = record.getMessage()
            hidden = mask(said)
            if hidden != said:
                record.msg, record.args = hidden, None
        return True


_FILTER = _Masking()


def _install_filter() -> None:
    for name in ("httpx", "httpcore"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
