# Sourced by the device scripts: the preflight waivers a device image needs (it is not this project's uv environment).
W=(--waive torch-build --reason "device image ships torch 2.11.0+cu130, not the profile's build"
   --waive env-drift --reason "device image is not a uv environment of this project"
   --waive cuda-libs --reason "device image carries CUDA 13 wheels" --waive model-source --reason "device copy of the working tree")
