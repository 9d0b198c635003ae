"""Print, as JSON, whether nixl, ucxx and torch are hidden, and rdt.available_transports(), here and in a Ray worker."""

import importlib.util
import json

import ray

import rdt_async as rdt


def probe():
    return [importlib.util.find_spec(p) is None for p in ("nixl", "ucxx", "torch")], rdt.available_transports()


if __name__ == "__main__":
    ray.init(address="local", include_dashboard=False)
    try:
        print(json.dumps([probe(), ray.get(ray.remote(probe).remote())]))
    finally:
        ray.shutdown()
