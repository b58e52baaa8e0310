//! Checks of a client's SDP offer before any peer connection exists, so a bad offer gets a
//! clear 400: it must parse, have a video section the worker can send its H.264 output on, and
//! offer H.264 or VP8 for any camera it sends.

use std::io::Cursor;

use webrtc::sdp::SessionDescription;

/// Largest SDP accepted, in bytes.
pub const MAX_SDP: usize = 64 * 1024;

/// What the offer says about video.
#[derive(Debug, PartialEq, Eq)]
pub struct Offer {
    /// The client sends a camera (some video section is sendrecv or sendonly).
    pub camera: bool,
}

/// A video section's direction and codec names (upper case).
#[derive(Debug)]
struct Video {
    sends: bool,
    receives: bool,
    codecs: Vec<String>,
}

fn videos(sdp: &SessionDescription) -> Vec<Video> {
    sdp.media_descriptions
        .iter()
        .filter(|m| m.media_name.media == "video" && m.media_name.port.value != 0)
        .map(|m| {
            let has = |k: &str| m.attributes.iter().any(|a| a.key == k);
            let (sends, receives) = if has("sendonly") {
                (true, false)
            } else if has("recvonly") {
                (false, true)
            } else if has("inactive") {
                (false, false)
            } else {
                (true, true)
            };
            let codecs = m
                .attributes
                .iter()
                .filter(|a| a.key == "rtpmap")
                .filter_map(|a| {
                    let v = a.value.as_deref()?;
                    let name = v.split_whitespace().nth(1)?.split('/').next()?;
                    Some(name.to_ascii_uppercase())
                })
                .collect();
            Video {
                sends,
                receives,
                codecs,
            }
        })
        .collect()
}

/// Parses and checks an offer; the error is the client's 400 message.
pub fn check(sdp: &str) -> Result<Offer, String> {
    if sdp.len() > MAX_SDP {
        return Err(format!(
            "bad SDP: {} bytes is over the limit of {MAX_SDP}",
            sdp.len()
        ));
    }
    let parsed = SessionDescription::unmarshal(&mut Cursor::new(sdp.as_bytes()))
        .map_err(|e| format!("bad SDP: {e}"))?;
    let videos = videos(&parsed);
    if videos.is_empty() {
        return Err("bad SDP: the offer has no video section (the output is video)".into());
    }
    let usable = |v: &Video| v.codecs.iter().any(|c| c == "H264" || c == "VP8");
    let Some(out) = videos.iter().find(|v| v.receives) else {
        return Err(
            "bad SDP: no video section can receive (make one sendrecv or recvonly for the output)"
                .into(),
        );
    };
    if !out.codecs.iter().any(|c| c == "H264") {
        return Err(format!(
            "unsupported codec: the output is H.264 and the offer's receiving video section has only {}",
            names(&out.codecs)
        ));
    }
    let cameras: Vec<&Video> = videos.iter().filter(|v| v.sends).collect();
    if let Some(bad) = cameras.iter().find(|v| !usable(v)) {
        return Err(format!(
            "unsupported codec: the camera must be H.264 or VP8, the offer has only {}",
            names(&bad.codecs)
        ));
    }
    Ok(Offer {
        camera: !cameras.is_empty(),
    })
}

fn names(codecs: &[String]) -> String {
    let mut c: Vec<&str> = codecs
        .iter()
        .map(String::as_str)
        .filter(|c| !matches!(*c, "RTX" | "RED" | "ULPFEC" | "FLEXFEC-03"))
        .collect();
    c.dedup();
    if c.is_empty() {
        "no codec".into()
    } else {
        c.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(sections: &[(&str, &[&str])]) -> String {
        let mut s =
            String::from("v=0\r\no=- 1 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\na=group:BUNDLE 0\r\n");
        for (i, (dir, codecs)) in sections.iter().enumerate() {
            let pts: Vec<String> = (0..codecs.len()).map(|k| (96 + k).to_string()).collect();
            s += &format!(
                "m=video 9 UDP/TLS/RTP/SAVPF {}\r\nc=IN IP4 0.0.0.0\r\na=mid:{i}\r\na={dir}\r\n",
                pts.join(" ")
            );
            for (k, c) in codecs.iter().enumerate() {
                s += &format!("a=rtpmap:{} {c}/90000\r\n", 96 + k);
            }
        }
        s
    }

    #[test]
    fn offers_are_checked_with_clear_reasons() {
        assert_eq!(
            check(&offer(&[("sendrecv", &["VP8", "H264"])])),
            Ok(Offer { camera: true })
        );
        assert_eq!(
            check(&offer(&[("recvonly", &["H264"])])),
            Ok(Offer { camera: false })
        );
        assert_eq!(
            check(&offer(&[("recvonly", &["H264"]), ("sendonly", &["VP8"])])),
            Ok(Offer { camera: true })
        );
        for (sdp, why) in [
            ("hello".to_string(), "bad SDP"),
            (offer(&[]), "no video section"),
            (offer(&[("sendonly", &["H264"])]), "can receive"),
            (
                offer(&[("sendrecv", &["AV1", "VP9", "rtx"])]),
                "unsupported codec: the output is H.264 and the offer's receiving video section has only AV1, VP9",
            ),
            (
                offer(&[("recvonly", &["H264"]), ("sendonly", &["VP9"])]),
                "the camera must be H.264 or VP8, the offer has only VP9",
            ),
        ] {
            let e = check(&sdp).expect_err(why);
            assert!(e.contains(why), "{why}: {e}");
        }
    }
}
