"""The NATS control plane: every message type, the client plumbing every service
shares, the embedded nats-server, its users and permissions."""
