//! The neighbour-port probe against real sockets on loopback: a ZMQ PUB is found without being
//! subscribed to, and a closed port, a ZMQ ROUTER (an engine's replay socket) and a silent TCP
//! server are not taken for publishers. Each probe waits at most 5 s (300 ms for the silent
//! server, which can only end by the deadline).

use std::net::TcpListener;
use std::time::Duration;

use kv_indexer::discover::{neighbour_port, neighbour_warning, publisher_answers};
use kv_indexer::endpoint::Endpoint;

const WAIT: Duration = Duration::from_secs(5);

/// Binds `kind` on an OS-chosen loopback port; returns it and its `tcp://` endpoint.
fn bound(zmq: &zmq::Context, kind: zmq::SocketType) -> (zmq::Socket, String) {
    let socket = zmq.socket(kind).expect("socket");
    socket.set_linger(0).unwrap();
    socket.bind("tcp://127.0.0.1:*").expect("bind");
    let endpoint = socket.get_last_endpoint().unwrap().expect("utf-8 endpoint");
    (socket, endpoint)
}

#[test]
fn a_publisher_on_the_neighbour_port_is_found_and_not_subscribed_to() {
    let zmq = zmq::Context::new();
    // An XPUB is a PUB that also hears subscriptions: it shows the probe subscribed to nothing.
    let (publisher, endpoint) = bound(&zmq, zmq::XPUB);
    publisher.set_rcvtimeo(300).unwrap();
    assert!(publisher_answers(&zmq, &endpoint, WAIT).expect("probe"));
    assert!(
        publisher.recv_bytes(0).is_err(),
        "the probe must not subscribe: nothing is indexed"
    );
    let (_plain_pub, endpoint) = bound(&zmq, zmq::PUB);
    assert!(publisher_answers(&zmq, &endpoint, WAIT).expect("probe"));
}

#[test]
fn a_closed_port_reports_nothing() {
    let zmq = zmq::Context::new();
    let endpoint = format!("tcp://127.0.0.1:{}", crate::support::free_port());
    assert!(!publisher_answers(&zmq, &endpoint, WAIT).expect("probe"));
}

#[test]
fn a_zmq_socket_that_is_not_a_publisher_is_not_taken_for_one() {
    let zmq = zmq::Context::new();
    let (_replay_router, endpoint) = bound(&zmq, zmq::ROUTER);
    assert!(!publisher_answers(&zmq, &endpoint, WAIT).expect("probe"));
}

#[test]
fn a_silent_tcp_server_reports_nothing_by_the_deadline() {
    let zmq = zmq::Context::new();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    assert!(!publisher_answers(&zmq, &endpoint, Duration::from_millis(300)).expect("probe"));
}

#[test]
fn the_static_fleet_check_reads_as_the_warning_says() {
    // rank 0 configured on `port`, a second rank running on `port + 1`: dp_size = 1 is short.
    let zmq = zmq::Context::new();
    let (_rank_1, endpoint) = bound(&zmq, zmq::PUB);
    let rank_1_port = Endpoint::parse(&endpoint).expect("an endpoint").port;
    let zmq_port = rank_1_port - 1;
    let neighbour = neighbour_port(zmq_port, 0, 1).expect("in range");
    let probed = format!("tcp://127.0.0.1:{neighbour}");
    assert!(publisher_answers(&zmq, &probed, WAIT).expect("probe"));
    assert_eq!(
        neighbour_warning("vllm-a", neighbour, 1),
        format!(
            "engine vllm-a: a publisher answers on {rank_1_port}; set dp_size = 2 or use discover"
        )
    );
}
