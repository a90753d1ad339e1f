"""The `tandem` command line and its launchers. Every `tandem` process imports this package
first, so gRPC's core settings (protocol/grpc_env.py) are in its environment before grpc is
imported."""

import os

from protocol.grpc_env import apply_grpc_env

apply_grpc_env(os.environ)
