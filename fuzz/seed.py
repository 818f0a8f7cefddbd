#!/usr/bin/env python3
"""Writes the fuzz targets' seed inputs, taken from the captured MassTransit messages in tests/fixtures/interop, into
fuzz/corpus/<target>/ (the layout each check in fuzz/checks.rs expects). Run once before a campaign; the corpus the
campaign keeps is minimised into the same folders and committed (the test suite replays it)."""
import base64, json, pathlib, struct

root = pathlib.Path(__file__).resolve().parent
fixtures = root.parent / "tests" / "fixtures" / "interop" / "messages"


def header_table(raw: bytes) -> bytes:
    """The header table in a content header's property bytes (MassTransit sets content type, then headers)."""
    flags = struct.unpack(">H", raw[:2])[0]
    at = 2
    if flags & (1 << 15):
        at += 1 + raw[at]
    if flags & (1 << 14):
        at += 1 + raw[at]
    if not flags & (1 << 13):
        return b"\0\0\0\0"
    size = struct.unpack(">I", raw[at:at + 4])[0]
    return raw[at:at + 4 + size]


def write(target: str, name: str, data: bytes) -> None:
    folder = root / "corpus" / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)


for path in sorted(fixtures.glob("*/*.json")):
    fixture = json.loads(path.read_text())
    name = f"{path.parent.name}-{path.stem}"
    body = base64.b64decode(fixture["body_base64"])
    message_id = fixture["properties"]["message_id"].encode()
    table = header_table(base64.b64decode(fixture["properties_raw_base64"]))
    split = bytes([len(message_id)])
    write("envelope", name, split + message_id + body)
    write("header_table", name, table)
    write("dead_letter_copy", name, split + message_id + b"\xff" + table)
    queue = fixture["captured_from_queue"].encode()[:255]
    write("replay_failure", name, bytes([len(queue)]) + queue + table)
    address = fixture["headers"].get("MT-Fault-InputAddress", {}).get("text")
    if address:
        write("address", name, address.encode())
write("address", "vhost-and-slash", b"\x0bprobe?q/%#1eu/parcel-created-carrier")
