//! Shared test helpers.
#![allow(dead_code)]

pub mod receiver;
