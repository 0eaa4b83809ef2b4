//! Encoding of event batches into the engines' msgpack payloads and ZMQ frames: the inverse of
//! `wire`, used by simulated engines and tests.
