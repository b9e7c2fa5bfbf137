"""The generated protobuf messages and gRPC stub (subpackage tandem.v1, made at build time).

They are not in the source tree: `cmake --build build` writes them to
build/clients/python/tandem/v1/, which joins this package when build/clients/python is on
sys.path (tandem/__init__.py extends the package path).
"""

try:
    import grpc  # noqa: F401  (checked first: its absence is the likelier and clearer problem)
except ImportError as e:
    raise ImportError(
        "tandem needs gRPC for Python: apt-get install python3-grpcio python3-protobuf "
        "(Debian's /usr/bin/python3 has them)") from e

try:
    from tandem.v1 import generation_pb2 as pb
    from tandem.v1 import generation_pb2_grpc as pb_grpc
except ImportError as e:
    raise ImportError(
        "tandem's generated stubs (tandem.v1) are missing: build them with "
        "`cmake --build build --target tandem_python_stubs` and put build/clients/python on "
        "PYTHONPATH next to clients/python") from e

__all__ = ["pb", "pb_grpc"]
