"""Secrets out of text that is shown or logged: database and server URIs in messages, tags and
logs. Plumbing: it knows no params schema, so every command can import it.

A password can sit in a URI's userinfo (`postgresql://u:pw@host/db`), in its query or fragment
(`?password=pw`, `&sslpassword=pw`, `#access_token=t`, any key naming a pass, pwd, secret or
token, also percent-encoded: `?pass%77ord=pw`), percent-encoded
in a query value that holds a connection string (`?odbc_connect=...%3BPWD%3Dpw`) or in a keyword
string (libpq's `host=h password='p w' dbname=db`, ODBC's `UID=u;PWD=pw`); every form is masked,
whatever else the text holds around it. A URL's user name is masked too: it may be a token
(`https://ghp_...@github.com/team/repo.git`), and nothing tells the two apart.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_plus

MASK = "***"
_SECRET_WORD = r"pass|pwd|secret|token|signature|credential|api[_-]?key"
_SECRET_KEY = rf"[\w.-]*(?:{_SECRET_WORD})[\w.-]*"
# A URI in free text ends at a blank or a line's end; a tab is taken into it (as a URI parser
# takes it into a password: `u:pass<TAB>word@`), so that no part of a secret is left shown.
# scheme://user:PASSWORD@host: the password ends at the last @ before the path; one with a `/`
# in it (base64 passwords hold them) ends at the first @, where SQLAlchemy ends it, not libpq.
_USERINFO = re.compile(r"(?P<keep>\b[A-Za-z][\w+.-]*://[^ \r\n/:@]*:)(?:[^ \r\n/]*|[^ \r\n@]*)@")
# Every ?key=value, &key=value and #key=value (a fragment carries tokens too:
# `#access_token=...`): the key as a server reads it, percent-decoded (`?pass%77ord=`); the value
# up to the next `&` or `#`, an ODBC `{...}` in it taken whole, blanks and `;` included.
_PARAM = re.compile(r"(?P<keep>[?&#](?P<key>[\w.%+-]+)=)"
                    r"(?P<value>(?:\{(?:[^}\r\n]|\}\})*\}?|[^&#{ \r\n])*)")
# password=... in a keyword string (libpq's `key = value`, single-quoted with \' or '' inside, or
# unquoted up to the next blank that no backslash escapes; ODBC's `;PWD=...`, braced as `{...}`
# with `}}` inside) or an environment dump (`PGPASSWORD=...`).
_KEYWORD = re.compile(rf"(?P<keep>(?:^|(?<=[\s,;(=\"'])){_SECRET_KEY}\s*=\s*)"
                      r"(?:'(?:[^'\\]|\\.|'')*'?|\"(?:[^\"\\]|\\.)*\"?|\{(?:[^}]|\}\})*\}?"
                      r"|(?:\\.|[^\s;\\])+\\?)",
                      re.IGNORECASE)
# scheme://USER@ or scheme://USER:***@ once its password is masked: the user name may be a token.
_USER = re.compile(r"(?P<keep>\b[A-Za-z][\w+.-]*://)[^ \r\n/:@]+(?::\*\*\*)?@")


def _param(match: re.Match) -> str:
    """A parameter whose decoded key names a secret, or whose decoded value holds a keyword
    string with a password (`?odbc_connect=...%3BPWD%3D...`): its whole value."""
    if (re.search(_SECRET_WORD, unquote_plus(match["key"]), re.IGNORECASE)
            or _KEYWORD.search(unquote_plus(match["value"]))):
        return match["keep"] + MASK
    return match[0]


def _without_passwords(text: str) -> str:
    text = _USERINFO.sub(rf"\g<keep>{MASK}@", text)
    text = _PARAM.sub(_param, text)
    return _KEYWORD.sub(rf"\g<keep>{MASK}", text)


def masked(text: str) -> str:
    """`text` with every password and every URL's user name replaced by ***; the rest (scheme,
    host, database) kept, so that a message still says which database it means."""
    return _USER.sub(rf"\g<keep>{MASK}@", _without_passwords(text))


def holds_password(text: str) -> bool:
    """A password in any form, as SQLAlchemy would read a URI too; a user name alone is none."""
    return _uri_without_password(text) != text


def holds_credentials(url: str) -> bool:
    """A password, or an http(s) URL's user name, where hosts take a token
    (`https://ghp_...@github.com/`); an SSH URL's (`ssh://git@host/`) is a login name."""
    return holds_password(url) or bool(re.match(r"https?://[^/@ \r\n]+@", url, re.IGNORECASE))


def masked_uri(uri: str) -> str:
    """A database URI (or libpq keyword string) without its password as SQLAlchemy, MLflow's and
    Optuna's parser, reads it: a raw blank or quote in the password, which would end a URI in
    free text, is still the password there (`postgresql://u:a b@h/db` connects with `a b`)."""
    return masked(_uri_without_password(uri))


def _uri_without_password(uri: str) -> str:
    text = _without_passwords(uri)
    try:
        from sqlalchemy.engine import make_url

        url = make_url(text)
    except Exception:  # noqa: BLE001 - not a URI SQLAlchemy reads: the patterns are all there is
        return text
    secret = re.compile(_SECRET_KEY, re.IGNORECASE)
    # SQLAlchemy keeps a #fragment in the last value: `***#x` is masked already.
    hidden = {k: MASK for k, v in url.query.items()
              if secret.fullmatch(k) and not re.fullmatch(r"\*\*\*(#\S*)?", str(v))}
    if url.password in (None, MASK) and not hidden:
        return text
    shown = url.set(query={**url.query, **hidden}).render_as_string(hide_password=True)
    return shown.replace("%2A%2A%2A", MASK)
