//! Integration tests of gpufeed-numa: a fake two-socket /sys tree, and this machine for real.

mod fake_sysfs;
mod live;
