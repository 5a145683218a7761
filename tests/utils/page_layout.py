"""A model of how JSONWriter lays out metrics.json (rust/hookloop-core/src/append.rs,
`page_aligned_lines`): a line of at most 4096 bytes that would cross a 4096-aligned offset
starts on it instead, and the line before it gets trailing spaces before its newline."""

PAGE = 4096


def padded(data: bytes, offset: int = 0) -> bytes:
    """`data` (whole lines) as JSONWriter writes it to a file `offset` bytes long that ends
    with a newline."""
    out = bytearray()
    for line in data.splitlines(keepends=True):
        used = (offset + len(out)) % PAGE
        if used and len(line) <= PAGE and used + len(line) > PAGE:
            if out:
                out[-1:] = b" " * (PAGE - used) + b"\n"
            else:
                raise ValueError("the first line pads the file's last line: pass it in data")
        out += line
    return bytes(out)


def crossed_boundaries(data: bytes) -> list:
    """The page boundaries (multiples of PAGE) that fall inside a line of `data` written from
    offset 0 as it is, after the line's first byte and before its newline: where a write cut
    at the boundary would tear the line."""
    out, start = [], 0
    for line in data.splitlines(keepends=True):
        end = start + len(line)
        out += range((start // PAGE + 1) * PAGE, end - 1, PAGE)
        start = end
    return out
