//! Several RabbitMQ nodes in one broker URL: the host list `amqp://user:password@host1:5672,host2:5672/vhost`
//! (the form other AMQP clients accept), or `--amqp-url` given once per node. Every node of a cluster shares the
//! credentials, the vhost and the options; only the host and port differ, so one URL holds them all.
//!
//! A connection goes to one node; when it cannot be made there, or is lost, the next node is tried (see
//! [`super::Broker::connect`]).

/// One URL per node of `url`: a URL with a single host comes back as it is; a host list becomes one URL per host,
/// each with the same scheme, credentials, path and query. A host list with an empty member is refused.
pub fn split(url: &str) -> Result<Vec<String>, String> {
    let Some(parts) = Parts::of(url) else {
        return Ok(vec![url.to_owned()]);
    };
    if !parts.hosts.contains(',') {
        return Ok(vec![url.to_owned()]);
    }
    if parts.hosts.split(',').any(str::is_empty) {
        return Err("its host list has an empty member (two commas, or one at an end)".to_owned());
    }
    Ok(parts
        .hosts
        .split(',')
        .map(|host| format!("{}{}{host}{}", parts.scheme, parts.userinfo, parts.rest))
        .collect())
}

/// The one URL that holds every node of `urls` (each a single host or a host list), for `--amqp-url` given more
/// than once; or why they cannot be one broker (another scheme, user, password, vhost or options: nodes of one
/// cluster differ only in where they are).
pub fn join(urls: &[String]) -> Result<String, String> {
    let mut nodes = Vec::new();
    for url in urls {
        nodes.extend(split(url)?);
    }
    let Some(first) = nodes.first() else {
        return Err("no RabbitMQ URL given".to_owned());
    };
    if nodes.len() == 1 {
        return Ok(first.clone());
    }
    let Some(head) = Parts::of(first) else {
        return Err("a URL given more than once must each be amqp[s]://…".to_owned());
    };
    let mut hosts = Vec::with_capacity(nodes.len());
    for node in &nodes {
        let parts = Parts::of(node)
            .ok_or_else(|| "a URL given more than once must each be amqp[s]://…".to_owned())?;
        if (parts.scheme, parts.userinfo, parts.rest) != (head.scheme, head.userinfo, head.rest) {
            return Err(
                "the URLs of one broker's nodes may differ only in host and port (the same scheme, user, \
                 password, vhost and options in each)"
                    .to_owned(),
            );
        }
        hosts.push(parts.hosts);
    }
    Ok(format!(
        "{}{}{}{}",
        head.scheme,
        head.userinfo,
        hosts.join(","),
        head.rest
    ))
}

/// A URL cut where its hosts are: `scheme://` `user:password@` `hosts` `/vhost?query`.
/// `url` (one node or a host list) in `vhost` instead of its own: the path replaced, percent-encoded, its query
/// kept. `url` unchanged if it is no `amqp[s]://` URL.
pub fn with_vhost(url: &str, vhost: &str) -> String {
    let Some(parts) = Parts::of(url) else {
        return url.to_owned();
    };
    let query = parts
        .rest
        .find(['?', '#'])
        .map_or("", |at| &parts.rest[at..]);
    let mut path = String::with_capacity(vhost.len() + 1);
    for b in vhost.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            path.push(char::from(b));
        } else {
            path.push_str(&format!("%{b:02X}"));
        }
    }
    format!(
        "{}{}{}/{path}{query}",
        parts.scheme, parts.userinfo, parts.hosts
    )
}

struct Parts<'a> {
    scheme: &'a str,
    userinfo: &'a str,
    hosts: &'a str,
    rest: &'a str,
}

impl<'a> Parts<'a> {
    fn of(url: &'a str) -> Option<Self> {
        let after_scheme = url.find("://")? + 3;
        let tail = &url[after_scheme..];
        let authority_end = tail.find(['/', '?', '#']).unwrap_or(tail.len());
        let authority = &tail[..authority_end];
        let hosts_start = authority.rfind('@').map_or(0, |at| at + 1);
        Some(Self {
            scheme: &url[..after_scheme],
            userinfo: &authority[..hosts_start],
            hosts: &authority[hosts_start..],
            rest: &tail[authority_end..],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_vhost_replaces_the_path_and_keeps_the_rest() {
        assert_eq!(
            with_vhost("amqps://u:p@h1:5671,h2/shop?heartbeat=5", "/"),
            "amqps://u:p@h1:5671,h2/%2F?heartbeat=5"
        );
        assert_eq!(
            with_vhost("amqp://localhost", "a b"),
            "amqp://localhost/a%20b"
        );
        assert_eq!(with_vhost("amqp://h/%2f", "orders"), "amqp://h/orders");
    }

    #[test]
    fn a_single_host_is_left_as_it_is() {
        for url in [
            "amqp://127.0.0.1:5672/%2f",
            "amqps://u:p@host/vhost?heartbeat=5",
            "amqp://localhost",
            "not a url",
        ] {
            assert_eq!(split(url).unwrap(), vec![url.to_owned()]);
        }
    }

    #[test]
    fn a_host_list_becomes_one_url_per_host_with_the_same_credentials_vhost_and_options() {
        assert_eq!(
            split("amqp://guest:pa,ss@a:5672,b:5673,c/v%2Fh?heartbeat=5").unwrap(),
            vec![
                "amqp://guest:pa,ss@a:5672/v%2Fh?heartbeat=5",
                "amqp://guest:pa,ss@b:5673/v%2Fh?heartbeat=5",
                "amqp://guest:pa,ss@c/v%2Fh?heartbeat=5",
            ]
        );
        assert_eq!(split("amqp://a,b").unwrap(), vec!["amqp://a", "amqp://b"]);
    }

    #[test]
    fn an_empty_member_of_a_host_list_is_refused() {
        for url in ["amqp://a,,b/", "amqp://a,/", "amqp://u@,a"] {
            assert!(split(url).unwrap_err().contains("empty member"), "{url}");
        }
    }

    #[test]
    fn repeated_urls_join_into_one_host_list_and_must_differ_only_in_where() {
        let urls = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            join(&urls(&["amqp://u:p@a:1/v", "amqp://u:p@b:2,c:3/v"])).unwrap(),
            "amqp://u:p@a:1,b:2,c:3/v"
        );
        assert_eq!(join(&urls(&["amqp://a/v"])).unwrap(), "amqp://a/v");
        for other in [
            "amqp://u:q@b/v",
            "amqp://u:p@b/w",
            "amqps://u:p@b/v",
            "amqp://b/v",
        ] {
            let e = join(&urls(&["amqp://u:p@a/v", other])).unwrap_err();
            assert!(e.contains("differ only in host and port"), "{other}: {e}");
        }
        assert!(join(&[]).is_err());
    }
}
