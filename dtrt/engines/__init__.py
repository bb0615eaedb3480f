"""TensorRT engines (DESIGN.md section 6): `dtrt build-engine` (build.py) with the optimization profiles it builds
(profile_bounds.py), and `dtrt doctor` (doctor.py). The engine directory's manifest, its checks and the machine key live
in dtrt.artifacts, which the runtime reads. TensorRT itself is imported only where a plan is built or run."""
