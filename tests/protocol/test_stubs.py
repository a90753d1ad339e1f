"""The committed gRPC stubs match their .proto files (`make proto` regenerates them).

Compared as descriptors, not text: the generated text carries the generator's version, the
descriptor is what the wire format is made of.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

REPO = Path(__file__).resolve().parents[2]
PROTOS = sorted(p.name for p in (REPO / "protocol").glob("*.proto"))


@pytest.mark.parametrize("proto", PROTOS)
def test_committed_stubs_match_the_proto(proto: str, tmp_path: Path) -> None:
    out = tmp_path / "set.pb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--descriptor_set_out={out}",
                    f"protocol/{proto}"], cwd=REPO, check=True)
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    for message in fresh.message_type:  # protoc fills json_name; generated stubs leave it out
        _clear_json_names(message)
    module = importlib.import_module(f"protocol.{proto.removesuffix('.proto')}_pb2")
    committed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    assert committed == fresh, f"protocol/{proto} changed: run `make proto` and commit the stubs"
    grpc_module = importlib.import_module(f"protocol.{proto.removesuffix('.proto')}_pb2_grpc")
    for service in fresh.service:
        assert hasattr(grpc_module, f"{service.name}Stub")
        assert hasattr(grpc_module, f"add_{service.name}Servicer_to_server")


def _clear_json_names(message: descriptor_pb2.DescriptorProto) -> None:
    for f in message.field:
        f.ClearField("json_name")
    for nested in message.nested_type:
        _clear_json_names(nested)
