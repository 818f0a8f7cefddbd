use super::*;

#[test]
fn masks_the_password_of_a_url() {
    assert_eq!(
        url("postgres://app:s3cret@db.internal:5432/parcels?sslmode=require"),
        "postgres://app:***@db.internal:5432/parcels?sslmode=require"
    );
    assert_eq!(
        url("amqp://guest@127.0.0.1:5672/%2f"),
        "amqp://guest@127.0.0.1:5672/%2f"
    );
    assert_eq!(
        url("amqp://127.0.0.1:5672/%2f"),
        "amqp://127.0.0.1:5672/%2f"
    );
    assert_eq!(url("amqp://u:p%40ss@h/v"), "amqp://u:***@h/v");
    assert_eq!(
        url("postgres://app@db/parcels?sslmode=require&password=s3cret-q&application_name=x"),
        "postgres://app@db/parcels?sslmode=require&password=***&application_name=x"
    );
    assert!(has_password("postgres://app@db/parcels?password=s3cret-q"));
    assert!(!has_password("postgres://app@db/parcels?sslmode=require"));
}

#[test]
fn an_unencoded_slash_question_mark_or_hash_masks_everything_up_to_the_last_at() {
    for (given, shown) in [
        (
            "postgres://postgres:pa#ss@127.0.0.1:5432/db",
            "postgres://***@127.0.0.1:5432/db",
        ),
        (
            "postgres://postgres:pa/s?s@127.0.0.1:5432/db",
            "postgres://***@127.0.0.1:5432/db",
        ),
        ("amqp://u:p@s/s@h/v", "amqp://***@h/v"),
        // An @ in the password but no / ? #: the user information is still clear.
        ("amqp://u:p@ss@h/v", "amqp://u:***@h/v"),
        // No // at all: from the scheme's colon.
        ("amqp:u:pw#x@h", "amqp:***@h"),
        // A password parameter holding an @ is masked whole, with what it makes ambiguous.
        (
            "postgres://app@db/x?password=p@ss&a=b",
            "postgres://***&a=b",
        ),
    ] {
        assert_eq!(url(given), shown, "{given}");
        assert!(has_password(given), "{given}");
    }
    // An @ after the host, in a vhost or a parameter: no password (a password file beside it was refused as a
    // second one).
    for given in [
        "amqp://app@rabbit:5672/team@eu",
        "postgres://app@db:5432/x?sslrootcert=/etc/ssl/ca@2025.pem",
        "postgres://db:5432/app?application_name=svc@n1",
        "amqp://rabbit:5672/team@eu",
        "amqp://[::1]:5672/team@eu",
    ] {
        assert!(!has_password(given), "{given}");
    }
    // As the drivers read them: the last @ of the authority ends the user information.
    for given in [
        "amqp://app:pw@rabbit:5672/team@eu",
        "postgres://ops@corp:S3cret@db:5432/app?sslrootcert=/etc/ssl/ca@2025.pem",
        "amqp://app:@dm1n@rabbit:5672/team@eu",
    ] {
        assert!(has_password(given), "{given}");
    }
    assert!(credentials_ambiguous("postgres://postgres:pa#ss@h/db"));
    assert!(!credentials_ambiguous("postgres://postgres:pa@ss@h/db"));
    assert!(!credentials_ambiguous("postgres://h/db"));
}

#[test]
fn any_string_is_safe_to_mask() {
    for given in [
        "",
        "@",
        "//",
        "//@",
        ":@",
        "a:b",
        "?password=",
        "p://u:é@h",
        "x://@@@",
    ] {
        let _ = url(given);
        let _ = has_password(given);
    }
}

proptest::proptest! {
    /// Whatever a password holds, written into a URL raw or percent-encoded, `url` never shows it, and once the URL
    /// is registered neither does `text`.
    #[test]
    fn no_password_survives_masking(
        password in "[a-zA-Z0-9@#/?:%&=+ é€😀\\u{202e}-]{8,24}",
        user in "[a-z@]{0,6}",
    ) {
        let encoded = url::form_urlencoded::byte_serialize(password.as_bytes()).collect::<String>();
        for written in [password.as_str(), encoded.as_str()] {
            let mut forms = vec![
                format!("postgres://{user}:{written}@127.0.0.1:5432/db?sslmode=disable"),
                format!("amqp://{user}:{written}@127.0.0.1:5672/%2f"),
            ];
            // An unencoded & starts the next parameter for every parser: what follows it cannot be told from one.
            if !written.contains('&') {
                forms.push(format!("postgres://{user}@127.0.0.1:5432/db?password={written}&sslmode=disable"));
            }
            for given in forms {
                let shown = url(&given);
                let template = given.replace(written, "");
                proptest::prop_assume!(!template.contains(password.as_str()));
                proptest::prop_assert!(!shown.contains(password.as_str()), "{given} -> {shown}");
                proptest::prop_assert!(!shown.contains(written), "{given} -> {shown}");
                register_url(&given);
                let scrubbed = text(&format!("error near {written} in {given}: {password}"));
                proptest::prop_assert!(!scrubbed.contains(password.as_str()), "{scrubbed}");
            }
        }
    }
}

#[test]
fn every_parameter_named_for_a_password_is_masked_and_registered() {
    assert_eq!(
        url(
            "postgres://a@h/d?sslkey=/k.pem&sslpassword=KeyPhr4se-x&sslmode=require&password=pw2-x"
        ),
        "postgres://a@h/d?sslkey=/k.pem&sslpassword=***&sslmode=require&password=***"
    );
    assert_eq!(
        url("postgres://a@h/d?application_name=password&sslmode=require"),
        "postgres://a@h/d?application_name=password&sslmode=require",
        "a value is not a name"
    );
    register_url("postgres://a@h/d?sslpassword=KeyPhr4se-y");
    assert_eq!(
        text("ignoring unrecognized connect parameter key=sslpassword value=KeyPhr4se-y"),
        "ignoring unrecognized connect parameter key=sslpassword value=***"
    );
    // No login password: a password file may give one.
    assert!(!has_password("postgres://a@h/d?sslpassword=k3y"));
    assert!(has_password("postgres://a@h/d?sslpassword=k3y&password=p"));
    for (given, driver) in [
        (
            "postgres://a@h/d?sslpassword=k&ey&sslmode=require",
            "postgres://a@h/d?sslmode=require",
        ),
        (
            "postgres://a@h/d?sslmode=require&sslpassword=k+y",
            "postgres://a@h/d?sslmode=require",
        ),
        ("postgres://a@h/d?sslpassword=k", "postgres://a@h/d"),
        (
            "postgres://a@h/d?password=p&sslpassword=k&x=1",
            "postgres://a@h/d?password=p&x=1",
        ),
    ] {
        assert_eq!(
            without_unused_password_parameters(given),
            (driver.to_owned(), true)
        );
    }
    assert_eq!(
        without_unused_password_parameters("postgres://a@h/d?password=p"),
        ("postgres://a@h/d?password=p".to_owned(), false)
    );
}

/// The driver decodes names (`pass%77ord=` logs in with its value): masked, and taken as the login's password.
/// `Password=` it ignores, and would log: masked, and left out of what it is given.
#[test]
fn a_password_parameter_whose_name_is_encoded_or_capitalised_is_masked() {
    let encoded = "postgres://app@db/parcels?sslmode=disable&pass%77ord=S3cretX";
    assert_eq!(
        url(encoded),
        "postgres://app@db/parcels?sslmode=disable&pass%77ord=***"
    );
    assert!(has_password(encoded));
    let capital = "postgres://app@db/parcels?Password=S3cretY";
    assert_eq!(url(capital), "postgres://app@db/parcels?Password=***");
    assert!(
        !without_unused_password_parameters(capital)
            .0
            .contains("S3cretY")
    );
    // The password the driver reads is what is registered, not the parameters after it.
    assert_eq!(
        url("postgres://app@db/x?password=s3cretQ&ssl-mode=require&options[search_path]=app"),
        "postgres://app@db/x?password=***&ssl-mode=require&options[search_path]=app"
    );
    for cut in [
        "postgres://app@db/parcels?password=Tr0ub&4dor&sslmode=require",
        "postgres://app@db/parcels?password=pa&ss=word",
        "postgres://app@db/parcels?sslmode=disable&password=x&y",
    ] {
        assert!(password_parameter_holds_ampersand(cut), "{cut}");
    }
    // Parameters the driver reads, after a password: nothing of it is cut.
    for whole in [
        "postgres://app@db/parcels?password=Tr0ub%264dor&sslmode=require",
        "postgres://app@db/x?password=s3cret&ssl-mode=require&statement-cache-capacity=0",
        "postgres://app@db/x?password=s3cret&options[search_path]=app",
        "postgres://app@db/x?password=s3cret",
        "postgres://app@db/x?sslmode=require",
        "postgres://app@db/x?password=s3cret&&sslmode=require",
        "postgres://app@db/x?password=s3cret&",
    ] {
        assert!(!password_parameter_holds_ampersand(whole), "{whole}");
    }
}

#[test]
fn registers_a_password_given_as_a_parameter() {
    register_url("postgres://app@db/x?password=q-param-pw");
    assert_eq!(
        text("password q-param-pw rejected"),
        "password *** rejected"
    );
}

#[test]
fn masks_urls_and_registered_secrets_in_free_text() {
    register_url("postgres://app:hunter2hunter2@db/x");
    let out =
        text("connect postgres://app:hunter2hunter2@db/x failed: password hunter2hunter2 rejected");
    assert!(!out.contains("hunter2hunter2"), "{out}");
    assert!(out.contains("postgres://app:***@db/x"), "{out}");
}

#[test]
fn registers_the_decoded_password_too() {
    register_url("amqp://u:p%40ssw0rd-x@h/v");
    assert_eq!(text("auth p@ssw0rd-x failed"), "auth *** failed");
}

/// Another service's fault text, as `find`, `failures`, `replay` and the consumer's logs show it: a long text cut to
/// its bound with a URL's password near the cut; a password holding a quote; JDBC's `;password=` inside a URL; a
/// query's `&password=` with no scheme. Each showed some of the password.
#[test]
fn other_services_passwords_are_masked_however_their_text_is_cut_or_quoted() {
    let long = format!(
        "{}postgres://svc:Sup3rS3cretPw@db/x{}",
        "x".repeat(240),
        " and more".repeat(12)
    );
    let cut = text_cut(&long, 300);
    assert!(!cut.contains("Sup3r"), "{cut}");
    for (said, secret) in [
        (
            "Npgsql: cannot connect to postgres://app:It's-Secret@db/parcels",
            "Secret",
        ),
        (
            "login failed: postgres://app:pa\"ss>wo`rd@db/parcels",
            "wo`rd",
        ),
        (
            "jdbc:sqlserver://db:1433;databaseName=parcels;user=sa;password=CorrectHorse",
            "CorrectHorse",
        ),
        (
            "POST /oauth/token?username=svc&password=CorrectHorse returned 401",
            "CorrectHorse",
        ),
    ] {
        let masked = text(said);
        assert!(!masked.contains(secret), "{said} -> {masked}");
    }
    // What is not a password stays.
    assert_eq!(
        text("see 'postgres://db:5432/parcels' and 'ops@example.com'"),
        "see 'postgres://db:5432/parcels' and 'ops@example.com'"
    );
}
