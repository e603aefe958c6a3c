"""Generated gRPC stubs (`make protos`); do not edit."""
