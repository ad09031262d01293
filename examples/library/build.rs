fn main() {
    hearth_build::link_libtorch();
}
