"""The trust boundary of every port: gRPC credentials (``grpc_auth``), which listeners may be open
without them (``exposure``), and which peers a service may be asked to dial (``peers``).
docs/deployment.md, "Threat model", says what each port exposes and to whom."""
from services.security.exposure import check_listeners
from services.security.grpc_auth import GrpcSecurity, Rejections
from services.security.peers import KnownPeers

__all__ = ["GrpcSecurity", "KnownPeers", "Rejections", "check_listeners"]
