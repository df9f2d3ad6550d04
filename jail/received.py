"""
received.py: reading what someone else made (a run directory, a run.zip, an exported bundle).

A run directory that arrives from another machine, a results/ folder, a bundle: its files are
untrusted input, like a harness. So every reader of them goes through here:

    inside(root, rel)             a path named by the run's own files, resolved inside root, or ValueError
    read_bytes(path, cap, root)   a regular file's bytes, no symbolic link below root followed, at most cap
    read_text / read_json / read_jsonl   the same, decoded; a bad file is one ValueError naming it
    walk_files(folder)            (relative name, path) of each regular file below, no link followed
    extract_zip(zip, dest)        members checked (names, count, bytes, ratio) before and while writing
    http_body(req, timeout)       an endpoint's reply: capped, one deadline for all of it, same-origin redirects
    loads(data, what)             JSON from someone else: ValueError naming what, never a RecursionError

What it does not do: decide what a file means (report.py, results.py, harness_archive), or run
anything (the sandbox does that). Links are refused rather than resolved: a received folder
has no reason to hold one, and following one is how a run named /proc/self/environ or
/etc/shadow into a report.
"""
import errno
import json
import os
import stat

MAX_FILE = 256 << 20      # one file of a run (metrics.jsonl, a candidate's traces.jsonl ...)
MAX_TEXT = 4 << 20        # a text meant to be shown (a harness source, a reply)
ZIP_MEMBERS = 20_000      # members of one zip (the largest committed run.zip: 165)
ZIP_BYTES = 2 << 30       # all members unpacked (the largest committed run.zip: 26 MB)
ZIP_RATIO = 200           # unpacked / packed bytes of one member (the committed ones: at most 28)
MAX_REPLY = 16 << 20      # one HTTP reply of an endpoint (a proposer's chat completion, an agent's)


def inside(root, rel):
    """root / rel when rel is a relative path that stays inside root (no '..' out, not absolute);
    else ValueError. For a path a run's own files name (config.json's "harness", say)."""
    rel = os.fspath(rel)
    parts = [p for p in rel.replace("\\", "/").split("/") if p not in ("", ".")]
    if os.path.isabs(rel) or not parts or ".." in parts or "\0" in rel:
        raise ValueError(f"{rel!r} is not a path inside {os.fspath(root)}")
    return os.path.join(os.fspath(root), *parts)


def _open_no_links(path, root):
    """An fd of path opened for reading with no symbolic link between root and it (each component
    below root is opened with O_NOFOLLOW from its parent's fd), or OSError (ELOOP for a link).
    root itself is the user's own choice (the folder they named) and may be reached through links."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    parts = [p for p in rel.split(os.sep) if p not in ("", ".")]
    if not parts or parts[0] == "..":
        raise OSError(errno.EACCES, "outside the folder it belongs to", os.fspath(path))
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                nxt = os.open(part, flags, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.ENOTDIR and not last:  # a link to a folder, with O_NOFOLLOW|O_DIRECTORY
                    raise OSError(errno.ELOOP, "a symbolic link is not followed", os.fspath(path)) from None
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path, cap=MAX_FILE, root=None, cut=False):
    """The bytes of a regular file, opened without following a symbolic link anywhere below root
    (default: the file's own folder) and read up to cap; ValueError naming the file when it is a
    link, outside root, not a regular file (a FIFO, a device) or over cap. OSError (e.g.
    FileNotFoundError) when it cannot be opened."""
    try:
        fd = _open_no_links(path, os.path.dirname(os.path.abspath(path)) if root is None else root)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EACCES):
            raise ValueError(f"{path}: {'a symbolic link (not followed)' if e.errno == errno.ELOOP else e.strerror}") from None
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"{path}: not a regular file")
        data = f.read(cap + 1)
    if len(data) > cap:
        if cut:  # (cut=True: its first cap bytes and a marker, instead of the error)
            return data[:cap] + f"\n[... cut at {cap:,} bytes]".encode()
        raise ValueError(f"{path}: over {cap:,} bytes")
    return data


def read_text(path, cap=MAX_TEXT, root=None):
    """The file as text, its first cap bytes and a marker when it is longer (a text is for showing:
    a huge one is cut, not refused); bytes that are not UTF-8 become U+FFFD."""
    return read_bytes(path, cap, root, cut=True).decode("utf-8", "replace")


def loads(text, where):
    """JSON from someone else (str or bytes): ValueError naming `where` for anything that is not
    JSON, including absurd nesting (json raises RecursionError) and bytes that are not UTF-8."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: absurd nesting
        raise ValueError(f"{where}: not valid JSON ({type(e).__name__})") from None


def read_json(path, cap=MAX_FILE, root=None):
    """The file's JSON value, or ValueError naming the file (a link, too big, not UTF-8, not JSON)."""
    data = read_bytes(path, cap, root)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 (byte {e.start})") from None
    return loads(text, path)


def read_jsonl(path, cap=MAX_FILE, root=None):
    """(rows, bad): the lines that parse as JSON objects, and how many did not (a line cut short
    by a crash, invalid UTF-8, absurd nesting). ValueError for the file as a whole (a link, too big)."""
    rows, bad = [], 0
    for line in read_bytes(path, cap, root).splitlines():
        if not line.strip():
            continue
        try:
            row = loads(line.decode("utf-8"), path)
        except (ValueError, UnicodeDecodeError):
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def walk_files(folder):
    """(name relative to folder with '/', path) of every regular file below folder, sorted; symbolic
    links (to files or folders) and anything else that is not a regular file or folder are skipped."""
    out = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not os.path.islink(os.path.join(root, d)))
        for name in files:
            path = os.path.join(root, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                out.append((os.path.relpath(path, folder).replace(os.sep, "/"), path))
    return sorted(out)


def extract_zip(packed, dest, max_members=ZIP_MEMBERS, max_bytes=ZIP_BYTES, max_ratio=ZIP_RATIO):
    """Unpack a received zip file into dest (an empty folder), checked first: at most max_members
    members, each a plain relative name inside dest (no link, no device), at most max_ratio times
    its packed size, and max_bytes in all; the bytes are counted again while they are written (a
    header can lie). ValueError naming the zip otherwise; what was written is left for the caller
    to remove."""
    import zipfile
    try:
        z = zipfile.ZipFile(packed)
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"{packed}: not a readable zip file ({e})") from None
    with z:
        members = z.infolist()
        if len(members) > max_members:
            raise ValueError(f"{packed}: {len(members):,} members, over the {max_members:,} allowed")
        if sum(m.file_size for m in members) > max_bytes:
            raise ValueError(f"{packed}: unpacks to over {max_bytes:,} bytes")
        written = 0
        for m in members:
            kind = (m.external_attr >> 16) & 0o170000
            if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise ValueError(f"{packed}: member {m.filename!r} is not a plain file or folder")
            if m.file_size > max_ratio * max(m.compress_size, 1) and m.file_size > 1 << 20:
                raise ValueError(f"{packed}: member {m.filename!r} unpacks {m.file_size // max(m.compress_size, 1)}x "
                                 f"(over {max_ratio}x)")
            target = inside(dest, m.filename)
            if m.is_dir():
                os.makedirs(target, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with z.open(m) as src, open(target, "xb") as out:
                while chunk := src.read(1 << 20):
                    written += len(chunk)
                    if written > max_bytes:
                        raise ValueError(f"{packed}: unpacks to over {max_bytes:,} bytes")
                    out.write(chunk)


def http_body(req, timeout, cap=MAX_REPLY):
    """The body of an HTTP(S) request to an endpoint someone else runs (a proposer's, an agent's):
    at most cap bytes (ValueError past it), the request as a whole bounded by `timeout` seconds
    (connect, headers and body), and redirects followed only within the same origin (scheme,
    host, port), so a 302 elsewhere never carries the request's Authorization header on
    (urllib.error.HTTPError instead). urllib's own timeout bounds each socket operation, so a
    server that drips its reply a byte at a time would never time out; here a watchdog thread
    shuts the connection's socket down at the deadline, which ends whatever read is blocked, and
    the caller gets TimeoutError."""
    import urllib.error
    import urllib.parse
    import urllib.request
    import http.client
    import socket
    import threading
    socks, done, expired = [], threading.Event(), threading.Event()

    def track(cls, **extra):  # the connection urllib makes, its socket kept for the watchdog (urllib
        def make(host, **kw):  # drops its own reference once the headers are in)
            conn = cls(host, **kw, **extra)
            connect = conn.connect

            def connect_and_keep():
                connect()
                socks.append(conn.sock)
            conn.connect = connect_and_keep
            return conn
        return make

    def watchdog():
        if done.wait(timeout):
            return
        expired.set()
        while not done.wait(0.05):  # until the caller is out (a socket may appear just after the deadline)
            for sock in socks:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
    http_h, https_h = urllib.request.HTTPHandler(), urllib.request.HTTPSHandler()
    http_h.http_open = lambda r: http_h.do_open(track(http.client.HTTPConnection), r)
    https_h.https_open = lambda r: https_h.do_open(track(http.client.HTTPSConnection), r, context=https_h._context)
    class SameOrigin(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, old, fp, code, msg, headers, newurl):
            a, b = urllib.parse.urlsplit(old.full_url), urllib.parse.urlsplit(urllib.parse.urljoin(old.full_url, newurl))
            if (a.scheme, a.hostname, a.port) != (b.scheme, b.hostname, b.port):
                raise urllib.error.HTTPError(old.full_url, code, f"redirect to another origin refused ({b.scheme}://"
                                             f"{b.hostname}): its credentials are not sent on", headers, fp)
            return super().redirect_request(old, fp, code, msg, headers, newurl)
    threading.Thread(target=watchdog, daemon=True).start()
    try:
        with urllib.request.build_opener(http_h, https_h, SameOrigin()).open(req, timeout=timeout) as r:
            data = r.read(cap + 1)
            if len(data) > cap:
                raise ValueError(f"the reply is over {cap:,} bytes")
    except urllib.error.HTTPError as e:  # keep the server's explanation (a context overflow, a quota)
        try:
            e.body = e.read(2000).decode("utf-8", "replace")
        except Exception:
            e.body = ""
        raise
    except (OSError, http.client.HTTPException) as e:
        if expired.is_set():
            raise TimeoutError(f"the request took over {timeout:g}s in all (connect, headers, body)") from e
        raise
    finally:
        done.set()
    if expired.is_set():  # a reply cut by the shutdown can still look complete
        raise TimeoutError(f"the request took over {timeout:g}s in all (connect, headers, body)")
    return data
