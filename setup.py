"""The wheel's packages (everything else is in pyproject.toml): kvfleet, and the folders
gateway/, worker/, shared/ and batch/ installed inside it as kvfleet.gateway, kvfleet.worker,
kvfleet.shared and kvfleet.batch, so the installed import names cannot collide with another
distribution's top-level `worker` or `shared` (kvfleet/__init__.py does the same for a checkout)."""

from setuptools import find_packages, setup

SUBPACKAGES = ("gateway", "worker", "shared", "batch")  # as kvfleet.SUBPACKAGES


def packages_and_folders() -> tuple[list[str], dict[str, str]]:
    packages = find_packages(include=["kvfleet", "kvfleet.*"])
    folders = {"kvfleet": "kvfleet"}
    for name in SUBPACKAGES:
        folders[f"kvfleet.{name}"] = name
        packages += [f"kvfleet.{name}"] + [f"kvfleet.{name}.{sub}" for sub in find_packages(name)]
    return packages, folders


if __name__ == "__main__":
    packages, folders = packages_and_folders()
    setup(packages=packages, package_dir=folders,
          package_data={package: ["*.cpp", "*.h"] for package in packages})
