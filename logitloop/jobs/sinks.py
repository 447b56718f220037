"""Where a job (`logitloop generate`, a Ray job) puts its results: without `--output`, text
blocks on stdout (`TextOutput`); with it, JSONL lines (`JsonlOutput`), never destroying or
duplicating them. Both take records (`write(records, n)`: in input order, or for a Ray job
as batches finish) and are closed at the end.

- `-` is stdout; a path that is not a regular file (`/dev/stdout` on a pipe or a terminal,
  `/dev/null`, a FIFO) is written as a stream: nothing to resume, nothing to replace.
- An existing regular file is resumed: it is locked (`fcntl.flock`, exclusive), a partial
  last line left by a killed run is cut off, its ids are read, and new lines are appended.
- A fresh file (`--overwrite`, or no file yet) is written to a temporary file next to it,
  put in place (atomically) with the first result: until then an old file stays as it was,
  so a job that fails validation, loading or compiling destroys nothing.
- A second run on the same file fails while the first holds the lock, naming the holder's
  process id when the system says (Linux: /proc/locks).
- A failed write (a full disk) is one `OutputError` naming the file and the reason; the
  lines written before it stay (each is fsync'ed), and a resume cuts a partial one.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

STDOUT = "-"


class OutputError(Exception):
    """A bad or unusable --output: one `logitloop: error: ...` line, exit status 2."""


def output_file(output: str) -> str:
    """A Ray job's `--output`: a file, or a folder (one that exists, or a path ending in
    '/') whose results go to `results.jsonl` in it."""
    path = Path(output).expanduser()
    if output.endswith(("/", os.sep)) or path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        return str(path / "results.jsonl")
    return output


def id_key(value: Any) -> tuple[str, Any]:
    """An id as a set key: the integer 1 and the string "1" are different ids."""
    return (type(value).__name__, value)


def describe_id(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def check_not_input(output: str, input_path: str | None) -> None:
    """Reject an output that is the input file (the same file, also through links)."""
    if output == STDOUT or input_path in (None, STDOUT):
        return
    try:
        same = os.path.samefile(input_path, output)
    except OSError:  # one of them does not exist (yet): not the same file
        return
    if same:
        raise OutputError(
            f"--output {output} is the input file {input_path}: results would replace the "
            "prompts; choose another --output"
        )


def _lock_holder(fd: int) -> int | None:
    """The pid holding a flock on the open file `fd`, from /proc/locks (None if unknown)."""
    st = os.fstat(fd)
    dev = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 12345 fd:01:67890 0 EOF"; waiters carry a "->" field.
        if len(fields) < 6 or fields[1] != "FLOCK" or "->" in fields:
            continue
        try:
            major, minor, inode = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == dev:
                return int(fields[4])
        except ValueError:
            continue
    return None


def _lock(file: IO[bytes], path: Path) -> None:
    """Hold an exclusive lock on `file` until it is closed, or fail naming the holder."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no advisory locks on this platform
        return
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _lock_holder(file.fileno())
        who = f"process {pid}" if pid is not None else "another process"
        file.close()
        raise OutputError(
            f"{path} is locked by {who}, another run writing the same --output; wait for it "
            "to finish (or stop it) and run again to resume"
        ) from None
    except OSError:  # pragma: no cover - a file system without locks: go on without
        return


def discard_stdout() -> None:
    """Point stdout at /dev/null, so that what is still buffered for it after a failed write
    (or a reader gone away) cannot fail again at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


class JsonlOutput:
    """JSONL results written to a file, resumed or fresh (see the module docstring).

    `open` locks and reads what it must before the job is validated; `write` appends
    records; `close` releases the lock (and removes a temporary file never put in place).
    """

    def __init__(self, path: Path, name: str):
        self.path = path
        self.name = name  # for messages
        self.done: set[tuple[str, Any]] = set()
        self._file: IO[bytes] | None = None  # the file results go to
        self._old: IO[bytes] | None = None  # a locked old file a fresh one replaces
        self._tmp: Path | None = None  # the fresh file until it is put in place
        self._fsync = True
        self._failed = False

    @classmethod
    def open(cls, output: str, overwrite: bool, warn: Callable[[str], None]) -> JsonlOutput:
        if output == STDOUT:
            out = cls(Path(output), "stdout")
            out._file, out._fsync = sys.stdout.buffer, False
            return out
        path = Path(output).expanduser()
        out = cls(path, str(path))
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            return out  # fresh: created at the first write
        except OSError as e:
            raise OutputError(f"cannot use output file {path}: {e.strerror or e}") from None
        if stat.S_ISDIR(mode):
            raise OutputError(f"output file {path} is a directory")
        if not stat.S_ISREG(mode):  # a pipe, a terminal, a device: a stream
            try:
                out._file = open(path, "ab")
            except OSError as e:
                raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
            out._fsync = False
            return out
        for _ in range(10):  # until the locked file is the one the path names
            try:
                file = open(path, "rb" if overwrite else "r+b")
            except FileNotFoundError:
                return out
            except OSError as e:
                raise OutputError(f"cannot open output file {path}: {e.strerror or e}") from None
            _lock(file, path)
            try:
                current = os.stat(path)
            except FileNotFoundError:
                current = None
            mine = os.fstat(file.fileno())
            if current is not None and (current.st_dev, current.st_ino) == (
                mine.st_dev,
                mine.st_ino,
            ):
                break
            file.close()  # replaced between open and lock: lock the new one
        else:  # pragma: no cover - replaced ten times over
            raise OutputError(f"{path} keeps being replaced by another process")
        if overwrite:
            out._old = file
        else:
            out._file = file
            out.done = out._resume(warn)
        return out

    def _resume(self, warn: Callable[[str], None]) -> set[tuple[str, Any]]:
        """Ids already in the (locked) file; a partial last line is cut off first."""
        f = self._file
        try:
            data = f.read()
            end = data.rfind(b"\n") + 1
            if end < len(data):
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
                warn(
                    f"{self.name}: dropped a partial last line ({len(data) - end} bytes) "
                    "left by an interrupted run"
                )
            f.seek(0, os.SEEK_END)
        except OSError as e:
            raise OutputError(
                f"cannot read output file {self.name} to resume: {e.strerror or e}"
            ) from None
        first_line: dict[tuple[str, Any], int] = {}
        duplicates: list[tuple[Any, int, int]] = []
        for lineno, raw in enumerate(data[:end].split(b"\n")[:-1], 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
                item_id = obj["id"]
                key = id_key(item_id)
                hash(key)
            except (ValueError, KeyError, TypeError, RecursionError):
                raise OutputError(
                    f"{self.name} line {lineno}: not a result line with an 'id'; refusing to "
                    "resume into it (use --overwrite to start it afresh)"
                ) from None
            if key in first_line:
                duplicates.append((item_id, first_line[key], lineno))
            else:
                first_line[key] = lineno
        if duplicates:
            item_id, a, b = duplicates[0]
            more = ", ..." if len(duplicates) > 1 else ""
            warn(
                f"{self.name} holds {len(duplicates)} duplicate result line"
                f"{'s' if len(duplicates) > 1 else ''} (id {describe_id(item_id)} on lines "
                f"{a} and {b}{more}), written by two runs at once; each id counts as done once"
            )
        return set(first_line)

    def _begin(self) -> None:
        """Create the fresh temporary file next to the output, locked."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self._file = open(tmp, "wb")
        except OSError as e:
            raise OutputError(f"cannot write output file {self.name}: {e.strerror or e}") from None
        self._tmp = tmp
        _lock(self._file, self.path)

    def _install(self) -> None:
        """Put the fresh file in place: replace the locked old one, or create the path (and
        fail if another run created it meanwhile)."""
        tmp, self._tmp = self._tmp, None
        try:
            if self._old is not None:
                os.replace(tmp, self.path)
            else:
                try:
                    os.link(tmp, self.path)
                except FileExistsError:
                    self._tmp = tmp
                    raise OutputError(
                        f"{self.name} was created by another run while this one was starting; "
                        "run again to resume it"
                    ) from None
                except OSError:  # pragma: no cover - no hard links here: plain rename
                    os.replace(tmp, self.path)
                else:
                    os.unlink(tmp)
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as e:
            raise OutputError(f"cannot write {self.name}: {e.strerror or e}") from None

    def write(self, records: Sequence[dict[str, Any]], n: int) -> None:
        del n
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        if self._file is None:
            self._begin()
        try:
            self._file.write(data.encode("utf-8"))
            self._file.flush()
            if self._fsync:
                os.fsync(self._file.fileno())
        except BrokenPipeError:
            raise
        except OSError as e:
            self._failed = True
            if self._file is getattr(sys.stdout, "buffer", None):
                discard_stdout()
            raise OutputError(f"cannot write {self.name}: {e.strerror or e}") from None
        if self._tmp is not None:
            self._install()

    def close(self) -> None:
        for file in (self._file, self._old):
            if file is None or file is getattr(sys.stdout, "buffer", None):
                continue
            try:
                file.close()
            except OSError as e:
                if not self._failed:
                    self._failed = True
                    raise OutputError(f"cannot write {self.name}: {e.strerror or e}") from None
        self._file = self._old = None
        if self._tmp is not None:  # never put in place: the old file (if any) stays
            try:
                os.unlink(self._tmp)
            except OSError:
                pass
            self._tmp = None


class TextOutput:
    """Completions as text on stdout: one block per completion, headed `==> ID <==` (`==> ID
    #k <==` for sample k of n) when `headers`; the token ids when there is no tokenizer."""

    def __init__(self, headers: bool):
        self.headers = headers
        self.blocks = 0

    def write(self, records: Sequence[dict[str, Any]], n: int) -> None:
        try:
            self._write(records, n)
        except BrokenPipeError:
            raise
        except OSError as e:
            discard_stdout()
            raise OutputError(f"cannot write stdout: {e.strerror or e}") from None

    def _write(self, records: Sequence[dict[str, Any]], n: int) -> None:
        out = sys.stdout
        for rec in records:
            texts = rec["text"] if n > 1 else [rec["text"]]
            for k, text in enumerate(texts):
                if text is None:  # no tokenizer: show the ids
                    ids = rec["token_ids"][k] if n > 1 else rec["token_ids"]
                    text = " ".join(map(str, ids))
                if self.headers:
                    sample = f" #{k}" if n > 1 else ""
                    sep = "\n" if self.blocks else ""
                    out.write(f"{sep}==> {rec['id']}{sample} <==\n")
                out.write(text + "\n")
                self.blocks += 1
        out.flush()

    def close(self) -> None:
        pass
