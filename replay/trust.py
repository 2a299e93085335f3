"""Who may make a re-run import code: the trust model of ``docs/security.md``, enforced.

A recording is data. Opening, inspecting, reporting and verifying it never imports anything it
names (the readers have no import at all). Only a re-run (``replay step``, ``replay bisect``)
imports code: the factory that rebuilds the target, the step function, the probes. Those names
come from the recording, so a recording handed over by someone else could name any module; this
module decides whether a re-run may import them:

* names the user chose are imported: ``--factory`` on the command line, and the ``factory``,
  ``steps`` and ``probes`` of the user's own ``[tool.replay]`` (a ``pyproject.toml`` at or above
  the working directory, never one inside the recording);
* names under a module prefix in ``[tool.replay] trusted = [...]`` are imported (and
  ``replay.workloads``, the reference engine shipped with replay);
* a rank file this user recorded on this machine and that has not changed since is imported
  without a prompt: it carries a signature (HMAC-SHA256 with a per-user key kept outside every
  recording, ``~/.config/replay/key``) over its target description, every byte that names code,
  paths or the factory's config;
* anything else needs ``--trust`` (``accept(recording)``), and is refused with one line
  (``UntrustedRecording``) that lists what would be imported and from where.

Whatever is decided, a directory inside the recording never stays on ``sys.path`` without
``--trust``: running ``python -m replay step .`` inside a recording would otherwise import a
``.py`` shipped beside it before the installed package of the same name.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.machinery
import json
import os
import secrets
import stat
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay.errors import UntrustedRecording
from replay.textsafe import escape

__all__ = [
    "ENV_ACCEPTED",
    "ENV_KEY_FILE",
    "Decision",
    "UntrustedRecording",
    "accept",
    "admit",
    "check",
    "key_path",
    "rank_signature_ok",
    "sign",
    "sign_manifest",
    "sign_rank",
    "signature_path",
    "user_choices",
]

ENV_KEY_FILE = "REPLAY_KEY_FILE"
# Recordings the user accepted with --trust in this process: inherited by the processes a re-run
# starts (bisection probes, one process per rank), which check again for themselves.
ENV_ACCEPTED = "REPLAY_TRUSTED_RECORDINGS"

# Module prefixes importable from any recording: code shipped with replay itself.
BUILTIN_TRUSTED = ("replay.workloads",)

_SIG_VERSION = 1
_MAX_SIG_BYTES = 4096
_KEY_BYTES = 32


# -- the key --------------------------------------------------------------------------------


def key_path() -> Path:
    """Where this user's signing key lives: ``$REPLAY_KEY_FILE``, or ``~/.config/replay/key``."""
    env = os.environ.get(ENV_KEY_FILE)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "replay" / "key"


def _read_key(path: Path) -> bytes | None:
    """The key, if it is a regular file of ours that nobody else can read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            return None
        raw = os.read(fd, 256).strip()
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(raw.decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return None
    return key if len(key) >= 16 else None


def _key(create: bool) -> bytes | None:
    """This user's key; created (0600, its directory 0700) on first use when ``create``."""
    path = key_path()
    key = _read_key(path)
    if key is not None or not create:
        return key
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, secrets.token_hex(_KEY_BYTES).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic: two ranks creating it at once agree on one key
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    except OSError:
        return None
    return _read_key(path)


def _key_id(key: bytes) -> str:
    return hashlib.sha256(b"replay-key-id\0" + key).hexdigest()[:16]


def _mac(key: bytes, what: str, name: str, payload: bytes) -> str:
    msg = b"replay-signature-v1\0" + what.encode() + b"\0" + name.encode() + b"\0" + payload
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str).encode()


# -- signatures -----------------------------------------------------------------------------


def signature_path(file: Path) -> Path:
    """The signature beside ``rank-NNNNN.h5`` (``rank-NNNNN.sig``) or a manifest (``manifest.json.sig``)."""
    return file.with_suffix(".sig") if file.suffix == ".h5" else file.with_name(file.name + ".sig")


def _write_sig(path: Path, body: dict[str, Any]) -> None:
    from replay.format import perms

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    perms.write_new(tmp, json.dumps(body, sort_keys=True).encode())
    os.replace(tmp, path)


def _read_sig(path: Path) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, _MAX_SIG_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > _MAX_SIG_BYTES:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _rank_name(h5: Path) -> str:
    return f"{h5.parent.name}/{h5.stem}"


def sign_rank(h5: Path, target: Any) -> bool:
    """Sign one sealed rank file's target description (what a re-run would import and build).

    Called by whoever seals a journal that this user's own process wrote; never raises (a rank
    that cannot be signed is only one that a re-run will ask ``--trust`` for).
    """
    try:
        key = _key(create=True)
        if key is None:
            return False
        _write_sig(signature_path(h5), {"v": _SIG_VERSION, "what": "target", "key": _key_id(key),
                                         "mac": _mac(key, "target", _rank_name(h5), _canonical(target))})
        return True
    except Exception:  # noqa: BLE001 - signing is a convenience; it must never fail a seal
        return False


def sign_manifest(manifest: Path) -> bool:
    """Sign a manifest file as it is now (the ``replay record`` that started the recording)."""
    try:
        key = _key(create=True)
        if key is None:
            return False
        raw = manifest.read_bytes()
        _write_sig(signature_path(manifest), {"v": _SIG_VERSION, "what": "manifest", "key": _key_id(key),
                                               "mac": _mac(key, "manifest", manifest.name, raw)})
        return True
    except Exception:  # noqa: BLE001
        return False


def _verdict(sig: dict[str, Any] | None, key: bytes | None, what: str, name: str, payload: bytes) -> str | None:
    """None when ``sig`` is this user's valid signature of ``payload``; else why not."""
    if sig is None:
        return "it is not signed"
    if key is None:
        return "there is no signing key here"
    if sig.get("key") != _key_id(key):
        return "it was signed by another user or on another machine"
    mac = sig.get("mac")
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(key, what, name, payload)):
        return "it changed after it was signed"
    return None


def rank_signature_ok(h5: Path, target: Any) -> str | None:
    """None when the rank file at ``h5`` carries this user's signature of ``target``; else why not."""
    return _verdict(_read_sig(signature_path(h5)), _key(create=False), "target", _rank_name(h5), _canonical(target))


def manifest_signature_ok(manifest: Path) -> str | None:
    try:
        fd = os.open(manifest, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return "it is not a regular file"
            raw = os.read(fd, 16 << 20)
        finally:
            os.close(fd)
    except OSError as e:
        return f"it cannot be read ({e.strerror})"
    return _verdict(_read_sig(signature_path(manifest)), _key(create=False), "manifest", manifest.name, raw)


def started_by_me(recording: Path, node: int | None = None) -> bool:
    """True when ``recording``'s manifest (of ``node``) was signed by this user's ``replay record``.

    ``replay seal`` signs the journals it seals only then: sealing someone else's crashed
    recording must not make the code it names importable without a prompt.
    """
    name = "manifest.json" if not node else f"manifest.node{node}.json"
    return manifest_signature_ok(Path(recording) / name) is None


def sign(recording: Path) -> list[str]:
    """Sign every sealed rank file and manifest of ``recording`` (whose content this user vouches
    for); the names signed. Use only on recordings you made: a signed rank file's code is
    imported by a re-run without asking."""
    from replay.format.h5 import read_rank_header

    done = []
    rec = Path(recording)
    for m in sorted(rec.glob("manifest*.json")):
        if m.is_file() and not m.is_symlink() and sign_manifest(m):
            done.append(m.name)
    for h5 in sorted(rec.glob("*/rank-*.h5")):
        if h5.is_symlink():
            continue
        try:
            target = read_rank_header(h5).get("target")
        except Exception:  # noqa: BLE001 - a rank file that cannot be read is not signed
            continue
        if sign_rank(h5, target):
            done.append(_rank_name(h5))
    return done


# -- what the user chose --------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class UserChoices:
    """What the user's own configuration says may be imported."""

    names: set[str] = field(default_factory=set)
    """``module:qualname`` names the user configured (factory, steps, probes)."""
    prefixes: tuple[str, ...] = BUILTIN_TRUSTED
    """Module prefixes whose code may be imported whatever recording names it."""
    source: Path | None = None
    """The pyproject.toml they came from."""


def _inside(path: str | os.PathLike[str], root: Path) -> bool:
    try:
        p = Path(os.path.realpath(path or os.getcwd()))
        r = Path(os.path.realpath(root))
    except (OSError, ValueError):
        return False
    return p == r or r in p.parents


def user_choices(recording: Path | None = None, start: Path | None = None) -> UserChoices:
    """``[tool.replay]`` of the nearest ``pyproject.toml`` at or above ``start`` (the working
    directory) that is not inside ``recording``: a recording cannot vouch for itself."""
    import tomllib

    here = Path(start or os.getcwd()).resolve()
    for d in [here, *here.parents]:
        p = d / "pyproject.toml"
        if recording is not None and _inside(p, Path(recording)):
            continue
        if not p.is_file():
            continue
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            return UserChoices(source=p)
        table = data.get("tool", {}).get("replay", {})
        if not isinstance(table, dict):
            return UserChoices(source=p)
        names: set[str] = set()
        for key in ("factory", "steps", "step", "probes"):
            v = table.get(key)
            for item in [v] if isinstance(v, str) else (v if isinstance(v, list) else []):
                if isinstance(item, str):
                    names.add(item)
        trusted = table.get("trusted")
        extra = tuple(t.strip(".") for t in trusted if isinstance(t, str) and t.strip(".")) if isinstance(trusted, list) else ()
        return UserChoices(names=names, prefixes=BUILTIN_TRUSTED + extra, source=p)
    return UserChoices()


def _module_of(name: str) -> str:
    return name.partition(":")[0]


def _under(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


# -- where a module would come from, without importing it ----------------------------------


def locate(module: str, path: Sequence[str] | None = None) -> str:
    """Where ``module`` would be imported from, found without running any of its code (a
    package's ``__init__`` included): a file, ``built-in``, or ``not found``."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        return str(getattr(loaded, "__file__", None) or "already imported")
    search = list(sys.path if path is None else path)
    parts = module.split(".")
    locations: list[str] | None = search
    origin = "not found"
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        mod = sys.modules.get(name)
        spec: Any
        if mod is not None:
            spec = getattr(mod, "__spec__", None)
        elif i == 0 and name in sys.builtin_module_names:
            return "built-in"
        else:
            try:
                spec = importlib.machinery.PathFinder.find_spec(name, locations)
            except (ImportError, ValueError, OSError):
                spec = None
        if spec is None:
            return "not found"
        origin = str(spec.origin) if spec.origin not in (None, "namespace") else "namespace package"
        locations = list(spec.submodule_search_locations or [])
    return origin


# -- the decision ---------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Decision:
    """What a re-run of one rank would import, and whether it may."""

    imports: list[str]
    """``module:qualname`` names the re-run imports."""
    refused: list[str]
    """Those that need consent."""
    why: str
    """Why the recording does not vouch for them (unsigned, changed, another user's)."""
    removed_paths: list[str] = field(default_factory=list)
    """``sys.path`` entries inside the recording that were taken off."""


def accepted(recording: Path) -> bool:
    """True when the user accepted ``recording`` with ``--trust`` (here or in a parent process)."""
    try:
        names = json.loads(os.environ.get(ENV_ACCEPTED, "[]"))
    except ValueError:
        return False
    real = os.path.realpath(recording)
    return isinstance(names, list) and real in names


def accept(recording: Path) -> None:
    """The user's ``--trust``: re-runs of ``recording`` in this process and the processes it
    starts may import what it names, and its directories may stay on ``sys.path``."""
    try:
        names = json.loads(os.environ.get(ENV_ACCEPTED, "[]"))
    except ValueError:
        names = []
    if not isinstance(names, list):
        names = []
    real = os.path.realpath(recording)
    if real not in names:
        os.environ[ENV_ACCEPTED] = json.dumps([*names, real])


def _recording_paths(recording: Path) -> list[str]:
    return [p for p in sys.path if _inside(p, recording)]


def check(
    recording: Path,
    imports: Sequence[str],
    paths: Sequence[str] = (),
    *,
    trust: bool = False,
    allow: Sequence[str] = (),
    user_names: Iterable[str] = (),
    signed: str | None = "it is not signed",
    what: str = "",
) -> Decision:
    """Decide whether a re-run may import ``imports`` (``module:qualname``) named by ``recording``
    and put ``paths`` on ``sys.path``; raise ``UntrustedRecording`` if not.

    ``signed`` is None when the rank file is this user's signed, unchanged recording (else the
    reason it is not); ``allow`` are trusted module prefixes; ``user_names`` the names the user
    chose. ``trust`` is the user's consent (``--trust``). Without consent, directories inside
    the recording are taken off ``sys.path`` (for the rest of this process), so that nothing
    shipped in it can shadow an installed module.
    """
    rec = Path(recording)
    consent = trust or accepted(rec)
    removed: list[str] = []
    if not consent:
        removed = _recording_paths(rec)
        if removed:
            sys.path[:] = [p for p in sys.path if p not in removed]
    # A signed recording of this user's may import what it names; otherwise only trusted
    # prefixes and the names the user chose.
    refused = [] if signed is None else _untrusted(imports, set(user_names), tuple(allow) + BUILTIN_TRUSTED)
    bad_paths = [p for p in paths if _inside(p, rec) or signed is not None]
    if consent or (not refused and not bad_paths):
        return Decision(imports=list(imports), refused=[], why=signed or "", removed_paths=removed)
    raise UntrustedRecording(_refusal(rec, refused, bad_paths, signed, what))


def _untrusted(imports: Sequence[str], chosen: set[str], prefixes: tuple[str, ...]) -> list[str]:
    """The names of ``imports`` (once each, in order) neither chosen by the user nor under a
    trusted module prefix."""
    return [n for n in dict.fromkeys(imports) if n not in chosen and not _under(_module_of(n), prefixes)]


def _refusal(rec: Path, refused: list[str], bad_paths: list[str], signed: str | None, what: str) -> str:
    """The one line that says what a recording would import, and why it is not allowed to."""
    shown = "; ".join(f"{escape(n)} (from {escape(locate(_module_of(n)))})" for n in refused[:4])
    if len(refused) > 4:
        shown += f"; and {len(refused) - 4} more"
    if bad_paths:
        shown += ("; " if shown else "") + "search paths " + ", ".join(escape(p) for p in bad_paths[:3])
    where = f"{escape(what)} of " if what else ""
    reason = signed or "those paths lie inside the recording"
    return (
        f"{where}{escape(rec)} would import {shown}, and {reason}: the recording is not known to be yours, "
        "so nothing it names is imported without consent. If you trust it, run again with --trust, "
        "or add the module prefix to `trusted = [...]` under [tool.replay] in your pyproject.toml"
    )


def admit(rank_file: Any, imports: Sequence[str], *, user_names: Iterable[str] = (), trust: bool = False) -> Decision:
    """``check`` for one rank file of a recording (a ``replay.format.reader.RankFile``): its
    signature, the user's ``[tool.replay]`` and ``--trust`` decide. What a re-run calls before
    it imports anything the rank file names."""
    part_dir = Path(rank_file.h5_path).parent
    recording = part_dir.parent
    target = rank_file.attrs.get("target")
    if rank_file.sealed:
        signed = rank_signature_ok(Path(rank_file.h5_path), target)
    else:
        signed = "it is still a journal (being recorded, or left by a crash and not sealed by you)"
    choices = user_choices(recording)
    return check(recording, imports, trust=trust, allow=choices.prefixes, user_names=set(user_names) | choices.names,
                 signed=signed, what=f"{part_dir.name} rank {rank_file.rank}")


def rerun_imports(target: Any, factory: str | None = None) -> list[str]:
    """The ``module:qualname`` names a re-run of a rank with this recorded ``target`` imports
    from the recording (``factory``: the user's ``--factory``, which replaces the recorded one)."""
    if not isinstance(target, dict) or not isinstance(target.get("step"), str):
        return []
    step = target["step"]
    is_method = "." in step.partition(":")[2]
    names = [] if is_method else [step]
    recorded = target.get("factory")
    if factory is None and isinstance(recorded, str):
        names.insert(0, recorded)
    for p in target.get("probes") or []:
        if isinstance(p, list) and p and isinstance(p[0], str):
            names.append(p[0])
    return names


def admit_part(part: Any, *, factory: str | None = None, trust: bool = False, recording: Path | None = None,
               ranks: Iterable[int] | None = None) -> list[str]:
    """Before a re-run of any rank of ``part`` (a ``replay.format.reader.Part``): raise
    ``UntrustedRecording`` unless every rank file's names may be imported; ``trust`` (the
    user's ``--trust``) accepts the recording for this process and those it starts. ``ranks``:
    only these (default: every rank file of the part). Returns what will be imported, each as
    ``module:qualname (from PATH)``, escaped for a terminal: a re-run says so before it does."""
    from replay.errors import RecordingDamaged

    shown: dict[str, None] = {}
    if trust:
        accept(Path(recording) if recording is not None else Path(part.path).parent)
    for rank in (list(part) if ranks is None else [r for r in ranks if r in part]):
        rf = part[rank]
        try:
            target = rf.attrs.get("target")
        except RecordingDamaged:
            continue  # cannot be re-run anyway; the re-run says why
        names = rerun_imports(target, factory)
        # Several models in one loop: a re-run of another stream's step imports that stream's step.
        streams = target.get("streams") if isinstance(target, dict) else None
        for info in (streams.values() if isinstance(streams, dict) else ()):
            if isinstance(info, dict):
                names += [n for n in rerun_imports({**target, **info}, factory) if n not in names]
        admit(rf, names, user_names=[factory] if factory else [], trust=trust)
        for n in names:
            shown[f"{escape(n)} (from {escape(locate(_module_of(n)))})"] = None
    return list(shown)


def seal_sign_after(recording: Path) -> float | None:
    """For ``replay seal``: sign the journals it seals that were written after this time, or
    (None) sign none. Only a recording whose manifest this user's ``replay record`` signed
    qualifies: sealing someone else's crashed recording must not make it trusted."""
    times = []
    for m in sorted(Path(recording).glob("manifest*.json")):
        if manifest_signature_ok(m) is not None:
            continue
        try:
            data = json.loads(m.read_bytes()[: 16 << 20])
        except (OSError, ValueError, RecursionError):
            continue
        t = data.get("started_at") if isinstance(data, dict) else None
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            times.append(float(t))
    return min(times) if times else None
