"""What every service shares: gRPC status errors (`errors`), server and channel helpers
(`grpc_utils`), authentication and the KV handle MAC (`security`), Prometheus metrics (`metrics`)
and engine types <-> protos (`convert`). The router, the workers and the KV transfer import these;
none of them imports another service's package for it.
"""
